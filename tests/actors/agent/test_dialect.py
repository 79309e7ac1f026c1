"""Token in, token out: a pretrained checkpoint's chat template and the standard ``<tool_call>`` format, with
what the policy sampled kept as sampled; the compact dialect is the tiny policy's episode, unchanged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from actors.agent.config import END, AgentConfig
from actors.agent.dialect import Dialect, load_dialect
from actors.agent.episode import resume_prompt_text, run_episode, summary_request_text, task_prompt_text
from actors.agent.trajectory import EpisodeEnd
from model.chat import STANDARD_TOOL_CALLS, ChatMessage, Role, ToolCall, ToolCallError, render_tool_call
from model.chat_template import JinjaChatTemplate, TemplateRenderError
from model.errors import CheckpointError
from model.generation import FinishReason, Generation
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from runtime.errors import ConfigError
from sandbox.tasks import Task
from sandbox.tools import TOOL_NAMES, tool_schemas

# Plain-text role markers (no special token between turns but the end token), so byte-level BPE merges can
# cross a turn boundary: "Assistant:" then a sampled " " re-encodes as one ": " token.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}"
                  "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}Assistant:{% endif %}")
# A template with a tool section, in the style of Qwen's: the tools as JSON lines in the system turn.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_TOOL_ROLE_TEMPLATE = ("{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
                         "{{ raise_exception('unknown role ' + m.role) }}{% endif %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = [(":", "Ġ"), ("d", "o"), ("n", "e"), ("do", "ne"), ("Ġ", "{"), ("<", "t")]


def _checkpoint(directory: Path, template: str, eos: str = "</s>", specials: Sequence[str] = ()) -> Path:
    """A tokenizer-only checkpoint: byte-level BPE with a few merges, and a tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (eos, *specials)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


class ScriptedPolicy:
    """Replies with fixed texts, each sampled one byte-level character per token: never the ids the
    tokenizer would give the text (it merges ': ', 'do', 'ne', ...)."""

    def __init__(self, tok: Tokenizer, replies: Sequence[str], end_id: int) -> None:
        self.tok, self.replies, self.end_id = tok, list(replies), end_id
        self.sampled: list[list[int]] = []

    def char_ids(self, text: str) -> list[int]:
        (mapped, _), = self.tok.pre_tokenizer.pre_tokenize_str(text)  # the byte-level characters
        return [self.tok.token_to_id(c) for c in mapped]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        text = self.replies.pop(0)
        closed = text.endswith("</s>")
        ids = self.char_ids(text.removesuffix("</s>")) + ([self.end_id] if closed else [])
        self.sampled.append(ids)
        n = len(ids)
        topk = torch.full((len(prompt_ids) + n, 1, 1), -1, dtype=torch.int16)
        return Generation(tuple(prompt_ids), tuple(ids), (-0.5,) * n, (0,) * n, topk,
                          FinishReason.STOP_TOKEN if closed else FinishReason.STOP_STRING)


async def _tools(name: str, args: dict) -> tuple[bool, str]:
    return True, f"{name} done: {json.dumps(args, sort_keys=True)}"


def test_a_five_turn_episode_trains_on_the_sampled_ids_where_decode_then_encode_would_merge(tmp_path: Path) -> None:
    dialect = Dialect.from_checkpoint(_checkpoint(tmp_path, PLAIN_TEMPLATE))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    call = render_tool_call(ToolCall("write_file", {"path": "done.py", "content": "done"}), STANDARD_TOOL_CALLS)
    replies = [" " + call, " I will run it. " + call + "</s>", " " + call, " " + call, " done</s>"]
    policy = ScriptedPolicy(tok, replies, dialect.end_id)
    task = Task("t", "Write done.py.", test_command="true")
    config = AgentConfig(max_turns=5, max_new_tokens_per_turn=200, max_total_tokens=8000)
    traj = asyncio.run(run_episode(task, policy.generate, _tools, dialect, config, SamplingParams(temperature=1.0)))

    assert traj.end is EpisodeEnd.FINAL_ANSWER and traj.num_turns == 5 and len(traj.tool_uses) == 4
    assert all(use.ok and use.name == "write_file" for use in traj.tool_uses)
    (seg,) = traj.segments
    trained = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    assert trained == [t for ids in policy.sampled for t in ids], "the trainer sees exactly the sampled ids"
    assert traj.policy_token_ids == trained
    # the case is real: decoding the episode and encoding it again gives other ids (merges across turns)
    whole = tok.decode(seg.token_ids, skip_special_tokens=False)
    assert tok.encode(whole, add_special_tokens=False).ids != seg.token_ids
    assert ":Ġ" in tok.encode(whole, add_special_tokens=False).tokens, "'Assistant:' + ' ' merges on re-encoding"
    # the sampled runs sit where they were sampled, and what is between them is the template's own text
    # (its generation prompt ends "Assistant:" where a rendered assistant turn has "Assistant: ")
    output = asyncio.run(_tools("write_file", {"path": "done.py", "content": "done"}))[1]
    conversation = [ChatMessage(Role.SYSTEM, dialect.system), ChatMessage(Role.USER, task.prompt)]
    for reply in replies[:4]:
        conversation += [ChatMessage(Role.ASSISTANT, reply.removesuffix("</s>")[1:]), ChatMessage(Role.TOOL, output)]
    conversation.append(ChatMessage(Role.ASSISTANT, "done"))
    rendered = JinjaChatTemplate.from_checkpoint(tmp_path).render(conversation, add_generation_prompt=False)
    assert dialect.tokenizer.decode(seg.token_ids) == rendered.removesuffix("\n")


def test_the_compact_dialect_is_the_tiny_policys_episode_unchanged() -> None:
    dialect, tok = Dialect.compact(), ByteTokenizer()
    task = Task("t", "returns 3", test_command="true")
    config = AgentConfig(summary_prompt="Sum up.", summary_header="Notes: ")
    assert dialect.prompt_ids(task.prompt) == tok.encode(task_prompt_text(task))
    assert dialect.tool_result_ids("ok", closed=False) == tok.encode(f"{END}<|tool|>ok{END}<|assistant|>")
    assert dialect.tool_result_ids("ok", closed=True) == tok.encode(f"<|tool|>ok{END}<|assistant|>")
    asked = dialect.tool_result_ids("ok", closed=True, then_ask=config.summary_prompt)
    assert asked == tok.encode(f"<|tool|>ok{END}") + tok.encode(summary_request_text(config))
    summary = tok.encode("x=1")
    head, tail = resume_prompt_text(task, "\x00", config).split("\x00")
    assert dialect.resume_prompt_ids(task.prompt, config.summary_header, summary) == (
        tok.encode(head) + summary + tok.encode(tail))
    assert dialect.stop_strings == ("</tool>",) and dialect.end_id == tok.end_token_id and dialect.system == ""


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, TOOLS_TEMPLATE, NO_TOOL_ROLE_TEMPLATE])
def test_templates_render_as_transformers_renders_them(tmp_path: Path, template: str) -> None:
    directory = _checkpoint(tmp_path, template, specials=("<|im_start|>", "<|im_end|>"))
    ours = JinjaChatTemplate.from_checkpoint(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    conversations = [[ChatMessage(Role.USER, "Write f.")],
                     [ChatMessage(Role.SYSTEM, "Be terse."), ChatMessage(Role.USER, "2+2?"),
                      ChatMessage(Role.ASSISTANT, "4"), ChatMessage(Role.USER, "and 3+3?")]]
    for conversation in conversations:
        for generation_prompt in (True, False):
            for tools in ((), tuple(tool_schemas())):
                messages = [{"role": m.role.value, "content": m.content} for m in conversation]
                expected = theirs.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
                assert ours.render(conversation, generation_prompt, tools) == expected


def test_tools_go_to_a_tool_section_or_else_to_the_system_turn(tmp_path: Path) -> None:
    with_section = Dialect.from_checkpoint(_checkpoint(tmp_path / "a", TOOLS_TEMPLATE, eos="<|im_end|>",
                                                       specials=("<|im_start|>",)))
    assert with_section.system == "" and [t["function"]["name"] for t in with_section.tools] == list(TOOL_NAMES)
    prompt = with_section.tokenizer.decode(with_section.prompt_ids("Write f."))
    assert prompt.startswith("<|im_start|>system\nTools:\n") and '"name": "write_file"' in prompt
    plain = Dialect.from_checkpoint(_checkpoint(tmp_path / "b", PLAIN_TEMPLATE))
    assert plain.tools == () and "<tool_call>" in plain.system and all(name in plain.system for name in TOOL_NAMES)
    prompt = plain.tokenizer.decode(plain.prompt_ids("Write f."))
    assert prompt.startswith("System: You are a coding agent") and prompt.endswith("User: Write f.\nAssistant:")
    assert with_section.tool_role is plain.tool_role is Role.TOOL
    refusing = Dialect.from_checkpoint(_checkpoint(tmp_path / "c", NO_TOOL_ROLE_TEMPLATE, eos="<|im_end|>",
                                                   specials=("<|im_start|>",)))
    assert refusing.tool_role is Role.USER, "a template that refuses the tool role gets results as user turns"
    after = refusing.tokenizer.decode(refusing.tool_result_ids("42", closed=True))
    assert after == "\n<|im_start|>user\n42<|im_end|>\n<|im_start|>assistant\n"


def test_standard_tool_calls_parse_and_malformed_ones_say_why(tmp_path: Path) -> None:
    dialect = Dialect.from_checkpoint(_checkpoint(tmp_path, PLAIN_TEMPLATE))
    text = 'I will.\n<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>'
    found = dialect.find_tool_call(text)
    assert found == ToolCall("run", {"command": "ls"})
    assert dialect.find_tool_call("no call here") is None
    for text, reason in [('<tool_call>{"name": "run", "args": {}}</tool_call>', "only name and arguments"),
                         ('<tool_call>{"name": "run"', "not closed with </tool_call>"),
                         ("<tool_call>[1]</tool_call>", "must be a JSON object"),
                         ('<tool_call>{"name": "run", "arguments": 3}</tool_call>', '"arguments" must be')]:
        error = dialect.find_tool_call(text)
        assert isinstance(error, ToolCallError) and reason in error.reason, (text, error)


def test_a_checkpoint_without_what_a_dialect_needs_is_refused_by_name(tmp_path: Path) -> None:
    assert load_dialect(tmp_path).tool_calls.open == "<tool>", "no tokenizer.json: the tiny policy's dialect"
    _checkpoint(tmp_path / "no_template", "")
    with pytest.raises(CheckpointError, match="has no chat template"):
        Dialect.from_checkpoint(tmp_path / "no_template")
    _checkpoint(tmp_path / "broken", "{% for m in messages %}")
    with pytest.raises(CheckpointError, match="not a chat template this renderer reads"):
        Dialect.from_checkpoint(tmp_path / "broken")
    _checkpoint(tmp_path / "unclosed", "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(CheckpointError, match="does not close an assistant turn with the end token"):
        Dialect.from_checkpoint(tmp_path / "unclosed")
    _checkpoint(tmp_path / "rewrites", "{% for m in messages %}{{ m.content | upper }}{{ eos_token }}{% endfor %}")
    with pytest.raises(CheckpointError, match="verbatim"):
        Dialect.from_checkpoint(tmp_path / "rewrites")
    directory = _checkpoint(tmp_path / "no_eos", PLAIN_TEMPLATE)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="names no eos_token"):
        Dialect.from_checkpoint(directory)
    with pytest.raises(TemplateRenderError, match="unknown role tool"):
        JinjaChatTemplate(NO_TOOL_ROLE_TEMPLATE).render([ChatMessage(Role.TOOL, "x")], True)


def test_a_final_answers_code_block_becomes_the_answer_file_when_asked(tmp_path: Path) -> None:
    dialect = Dialect.from_checkpoint(_checkpoint(tmp_path, PLAIN_TEMPLATE))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    answer = " Here:\n```python\ndef f(x):\n    return x\n```\nand a note\n```\nnot code\n```</s>"
    task = Task("t", "Write f.", test_command="true")
    for answer_file, expected in [("solution.py", [("write_file", {"path": "solution.py", "content": "not code\n"})]),
                                  ("", [])]:
        calls: list[tuple[str, dict]] = []

        async def record(name: str, args: dict) -> tuple[bool, str]:
            calls.append((name, args))  # noqa: B023 (awaited within this iteration)
            return True, "ok"

        policy = ScriptedPolicy(tok, [answer], dialect.end_id)
        config = AgentConfig(answer_file=answer_file, max_total_tokens=8000)
        traj = asyncio.run(run_episode(task, policy.generate, record, dialect, config, SamplingParams(temperature=1.0)))
        assert traj.end is EpisodeEnd.FINAL_ANSWER and traj.tool_uses == [] and calls == expected
        assert traj.policy_token_ids == policy.sampled[0], "the answer's tokens are trained as sampled either way"
    with pytest.raises(ConfigError, match="relative path inside the workspace"):
        AgentConfig(answer_file="../x.py")
