"""How the dashboard's rollout viewer sees the RL trainer's samples (``dashboard.sample_views`` in the run
file names `run_sample_views`, which gives how to get `sample_views` with the run's policy's tokenizer: at once,
or once the run has built its pretrained policy, without ever building it): one stored record in, one
JSON-ready view per sample out.

A group record (`group_sample_views`) gives each sample's whole view: its tokens as runs of consecutive tokens
that share a policy version and a loss mask (decoded together, so a character split over byte tokens reads
whole), each with the mean behaviour log-prob of its tokens and, for a trained run that is not all ASCII (whose
tokens are its characters), each token's own text (`PIECE_SEPARATOR` between them; a byte that only starts a
character has "" and the character shows on its last byte); the reward and its components, the hidden tests,
the tool calls, how the episode ended and the advantage grouping gave it. A chain's segments (self-summarization)
follow one another in ``tokens``, each after a separator run (`SEGMENT_BREAK`, version -1, untrained, no
tokens). ``behaviour_logprobs`` has, per segment, every token's behaviour log-prob.

A sample's `TrainerLogprobs`, stored when the trainer trained it (`trainer_logprob_views`), add to its view
``trainer_version`` and ``trainer_logprobs``: per segment, every token's log-prob under the trainer's forward
(NaN where it is not trained). Per-token arrays travel as base64 of little-endian float32 (a few bytes a token:
the viewer keeps hundreds of groups).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import dataclasses
import functools
import itertools
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy
import zstandard

from actors.records import GroupRecord, TrainerLogprobs, decode_record, trainer_logprobs_key
from model.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from actors.pretrained_policy import PretrainedRecipe
    from runtime.blob import BlobStore
    from runtime.bus import Bus

SampleViews = Callable[[str, bytes], list[dict[str, Any]]]

_BYTES = ByteTokenizer()
SEGMENT_BREAK = "\n[context summarized: a new segment]\n"
PIECE_SEPARATOR = "\x1f"  # between the tokens' texts of a trained run (a token's own \x1f shows as "\u241f")
_TRAINER_SUFFIX = trainer_logprobs_key("").removeprefix("samples/")  # "/trainer-logprobs"


def run_sample_views(config: Any) -> Callable[..., Awaitable[SampleViews]]:
    """How the dashboard gets `sample_views` decoding with the tokenizer of the run's policy (``config``: the
    run's `actors.config.RLConfig`): the tiny policy's bytes, or a pretrained checkpoint's tokenizer.json
    (``policy.checkpoint``, or ``policy.pretrained``: the run's build, `load_pretrained_views`)."""
    policy = config.policy
    if policy.pretrained:
        return functools.partial(load_pretrained_views, policy.pretrained_recipe(), policy.cache_dir)
    return functools.partial(_ready_views, policy.checkpoint)


async def _ready_views(directory: str, **_: object) -> SampleViews:
    return functools.partial(sample_views, tokenizer=await asyncio.to_thread(_tokenizer, directory))


async def load_pretrained_views(recipe: PretrainedRecipe, cache_dir: str | os.PathLike[str], *, blob: BlobStore,
                                bus: Bus | None, owner: str, waiting: Callable[[str], object]) -> SampleViews:
    """`sample_views` with the tokenizer of the run's build of the pretrained policy ``recipe``: this machine's
    build, else its tokenizer's files alone from the run's store, waited for while the run builds it (``waiting``
    says so first). Never builds the policy (`actors.pretrained_policy.run_pretrained_files`).

    Raises:
        TimeoutError: the run did not store its build within the build's bound.
        FileNotFoundError: ``bus`` None (a finished run) and the run never stored its build.
    """
    from actors.agent.dialect import DIALECT_FILES  # the tokenizers library: only where a view is made
    from actors.pretrained_policy import run_pretrained_files

    directory = await run_pretrained_files(bus, blob, recipe, cache_dir, DIALECT_FILES, owner=owner,
                                           on_wait=lambda: waiting(f"the run's policy build {recipe.build_name()}"))
    return functools.partial(sample_views, tokenizer=await asyncio.to_thread(_tokenizer, str(directory)))


def _tokenizer(directory: str) -> Tokenizer:
    from actors.agent.dialect import load_dialect  # the tokenizers library: only where a view is made

    return load_dialect(directory).tokenizer if directory else _BYTES


def sample_views(key: str, stored: bytes, tokenizer: Tokenizer = _BYTES) -> list[dict[str, Any]]:
    """The views a stored record gives: whole ones from a group record, the trainer's log-probs of a sample
    from its `TrainerLogprobs` (the dashboard adds those to the sample's kept view).

    Raises:
        ValueError: a record that does not decompress or is not of the type its key says.
    """
    if key.endswith(_TRAINER_SUFFIX):
        return trainer_logprob_views(key, stored)
    return group_sample_views(key, stored, tokenizer)


def trainer_logprob_views(key: str, stored: bytes) -> list[dict[str, Any]]:
    """``[{"sample_id", "trainer_version", "trainer_logprobs"}]`` of the `TrainerLogprobs` stored at ``key``."""
    record = decode_record(_decompress(key, stored), TrainerLogprobs, key)
    return [{"sample_id": record.sample_id, "trainer_version": record.version,
             "trainer_logprobs": [base64.b64encode(seg).decode() for seg in record.segments]}]


def _decompress(key: str, stored: bytes) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(stored)
    except zstandard.ZstdError as e:
        raise ValueError(f"record {key!r} does not decompress: {e}") from None


def group_sample_views(key: str, stored: bytes, tokenizer: Tokenizer = _BYTES) -> list[dict[str, Any]]:
    """The views of the samples of the group record stored (zstd-compressed) at ``key``.

    Raises:
        ValueError: a record that does not decompress or is not a group record (`RecordError` says which).
    """
    record = decode_record(_decompress(key, stored), GroupRecord, key)
    views = []
    for sample in record.samples:
        t = sample.trajectory
        versions = [v for seg in t.segments for v in seg.versions if v >= 0]
        views.append({
            "sample_id": sample.sample_id, "group_id": record.group_id, "prompt_id": record.prompt_id,
            "version": max(versions, default=0), "min_version": min(versions, default=0),
            "reward": sample.reward, "advantage": sample.advantage,
            "passed": sample.components.num_passed == sample.components.num_tests > 0,
            "end": str(t.end), "num_turns": t.num_turns, "num_tokens": t.num_tokens,
            "num_summaries": t.num_summaries,
            "components": dataclasses.asdict(sample.components),
            "tests": {test.name: test.passed for test in sample.tests},
            "tool_uses": [dataclasses.asdict(u) for u in t.tool_uses],
            "tokens": [run for i, seg in enumerate(t.segments)
                       for run in ([[SEGMENT_BREAK, -1, 0, 0.0, 0]] if i else [])
                       + _runs(seg.token_ids, seg.versions, seg.loss_mask, seg.behaviour_logprobs, tokenizer)],
            "behaviour_logprobs": [_float32_base64(seg.behaviour_logprobs) for seg in t.segments],
        })
    return views


def _runs(token_ids: list[int], versions: list[int], mask: list[int], logprobs: list[float],
          tokenizer: Tokenizer) -> list[list[Any]]:
    """[text, version, trained (0/1), mean behaviour log-prob, number of tokens, the tokens' texts (trained
    runs but byte-tokenized ASCII ones, whose tokens are their characters; "" otherwise)] per run of tokens alike."""
    by_bytes = isinstance(tokenizer, ByteTokenizer)
    rows = zip(token_ids, versions, mask, logprobs, strict=False)
    runs = []
    for (version, trained), run in itertools.groupby(rows, key=lambda r: (r[1], r[2])):
        run = list(run)
        ids = [r[0] for r in run]
        mean = sum(r[3] for r in run) / len(run) if trained else 0.0
        # an ASCII run's tokens are its characters, one each: the page splits its text (less to keep)
        ascii_bytes = by_bytes and all(0 <= i < 128 for i in ids)
        pieces = PIECE_SEPARATOR.join(_pieces(ids, tokenizer)) if trained and not ascii_bytes else ""
        runs.append([tokenizer.decode(ids), version, int(trained), mean, len(run), pieces])
    return runs


def _pieces(token_ids: list[int], tokenizer: Tokenizer) -> list[str]:
    """Each token's own text: a byte token adds what it completes of a UTF-8 character, a special token its name;
    a subword token its decoding."""
    if not isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.decode([token]).replace(PIECE_SEPARATOR, "\u241f") for token in token_ids]
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for token in token_ids:
        if 0 <= token < 256:
            piece = utf8.decode(bytes([token]))
        else:
            piece = utf8.decode(b"", final=True) + tokenizer.decode([token])
            utf8.reset()
        pieces.append(piece.replace(PIECE_SEPARATOR, "\u241f"))
    return pieces


def _float32_base64(values: list[float]) -> str:
    return base64.b64encode(numpy.asarray(values, dtype="<f4").tobytes()).decode()
