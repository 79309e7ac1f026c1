"""The rollout viewer's view of a real group record, as grouping writes it."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy
import pytest
import zstandard

from actors.agent.trajectory import EpisodeEnd, Segment, Trajectory
from actors.records import (
    GroupRecord,
    GroupSample,
    RewardBreakdown,
    TestResult,
    TrainerLogprobs,
    encode_record,
    trainer_logprobs_key,
)
from actors.sample_views import PIECE_SEPARATOR, SEGMENT_BREAK, group_sample_views, sample_views
from model.tokenizer import ByteTokenizer


def _record() -> bytes:
    tok = ByteTokenizer()
    ids = tok.encode("ab") + tok.encode("é!")  # "é" is two byte tokens: one run decodes it whole
    trajectory = Trajectory([Segment(token_ids=ids, loss_mask=[0, 0, 1, 1, 1],
                                     behaviour_logprobs=[0.0, 0.0, -0.5, -0.1, -1.0], logprob_temperatures=[1.0] * 5,
                                     versions=[-1, -1, 3, 3, 4], topk_ids_TLK=None, prompt_len=2)],
                            end=EpisodeEnd.FINAL_ANSWER)
    components = RewardBreakdown(1.0, 2, 2, 0.0, 0.0, 0, 0.0, 1.0)
    sample = GroupSample("s1", 1.0, components, 0.5, trajectory, (TestResult("t1", True), TestResult("t2", True)))
    record = GroupRecord("g1", "p1", 3, 4, 0.0, (sample,))
    return zstandard.ZstdCompressor().compress(encode_record(record))


def test_a_group_record_becomes_sample_views() -> None:
    (view,) = group_sample_views("groups/g1/a0", _record())
    assert (view["sample_id"], view["group_id"], view["prompt_id"], view["version"]) == ("s1", "g1", "p1", 4)
    assert view["passed"] and view["tests"] == {"t1": True, "t2": True} and view["advantage"] == 0.5
    texts = [(run[0], run[1], run[2]) for run in view["tokens"]]
    assert texts == [("ab", -1, 0), ("é", 3, 1), ("!", 4, 1)]


def test_what_is_not_a_group_record_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not decompress"):
        group_sample_views("groups/g1/a0", b"junk")
    with pytest.raises(ValueError, match="GroupRecord 'groups/g1/a0'"):
        group_sample_views("groups/g1/a0", zstandard.ZstdCompressor().compress(b"\x93\x01\x02\x03"))


def test_a_chains_segments_follow_one_another_after_a_break() -> None:
    tok = ByteTokenizer()
    segments = [Segment(tok.encode(text), [0, 1], [0.0, -0.5], [1.0] * 2, [-1, 2], None, 1, summary_len=s)
                for text, s in (("ab", 1), ("cd", 0))]
    sample = GroupSample("s1", 1.0, RewardBreakdown(1.0, 1, 1, 0.0, 0.0, 0, 0.0, 1.0), 0.5,
                         Trajectory(segments, EpisodeEnd.FINAL_ANSWER))
    stored = zstandard.ZstdCompressor().compress(encode_record(GroupRecord("g1", "p1", 2, 2, 0.0, (sample,))))
    (view,) = group_sample_views("groups/g1/a0", stored)
    assert [run[0] for run in view["tokens"]] == ["a", "b", SEGMENT_BREAK, "c", "d"]
    assert view["num_summaries"] == 1 and view["num_tokens"] == 4


def _float32s(b64: str) -> list[float]:
    return numpy.frombuffer(base64.b64decode(b64), dtype="<f4").tolist()


def test_a_trained_run_carries_each_tokens_text_and_the_segment_its_behaviour_log_probs() -> None:
    (view,) = sample_views("groups/g1/a0", _record())
    pieces = [run[5].split(PIECE_SEPARATOR) if run[5] else [] for run in view["tokens"]]
    assert pieces == [[], ["", "é"], []], "a character's first byte has no text of its own: its last shows it"
    assert (view["tokens"][2][0], view["tokens"][2][4]) == ("!", 1), "an ASCII run: one character a token"
    (behaviour,) = view["behaviour_logprobs"]
    assert _float32s(behaviour) == pytest.approx([0.0, 0.0, -0.5, -0.1, -1.0])


def test_the_trainers_log_probs_of_a_sample_become_a_partial_view() -> None:
    values = [numpy.array([math.nan, 1.5, -0.25], dtype="<f4"), numpy.array([math.nan, -2.0], dtype="<f4")]
    record = TrainerLogprobs("g1-s0", 6, tuple(v.tobytes() for v in values))
    key = trainer_logprobs_key("g1-s0")
    (partial,) = sample_views(key, zstandard.ZstdCompressor().compress(encode_record(record)))
    assert (partial["sample_id"], partial["trainer_version"]) == ("g1-s0", 6) and set(partial) == {
        "sample_id", "trainer_version", "trainer_logprobs"}
    decoded = [_float32s(b) for b in partial["trainer_logprobs"]]
    assert [d[1:] for d in decoded] == [[1.5, -0.25], [-2.0]] and all(math.isnan(d[0]) for d in decoded)
    with pytest.raises(ValueError, match="TrainerLogprobs"):  # a group record where its key says log-probs
        sample_views(key, _record())


def tokenized_group_record(tokenizer_dir: Path, prompt: str, answer: str, group_id: str = "g1") -> bytes:
    """A stored group record of one sample: ``prompt`` then ``answer`` (trained, version 0) in the tokens of the
    tokenizer.json in ``tokenizer_dir``."""
    from model.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_dir, end_token="</s>")
    prompt_ids, answer_ids = tok.encode(prompt), tok.encode(answer)
    ids, n, k = prompt_ids + answer_ids, len(prompt_ids) + len(answer_ids), len(answer_ids)
    trajectory = Trajectory([Segment(token_ids=ids, loss_mask=[0] * (n - k) + [1] * k,
                                     behaviour_logprobs=[0.0] * n, logprob_temperatures=[1.0] * n,
                                     versions=[-1] * (n - k) + [0] * k, topk_ids_TLK=None, prompt_len=n - k)],
                            end=EpisodeEnd.FINAL_ANSWER)
    sample = GroupSample(f"{group_id}-s0", 1.0, RewardBreakdown(1.0, 1, 1, 0.0, 0.0, 0, 0.0, 1.0), 0.5, trajectory, ())
    return zstandard.ZstdCompressor().compress(encode_record(GroupRecord(group_id, "p1", 0, 0, 0.0, (sample,))))


async def _loaded(config: object, blob: object = None) -> object:
    """The views the dashboard's loader gives for ``config`` (no bus: as a finished run's reader)."""
    from actors.sample_views import run_sample_views

    return await run_sample_views(config)(blob=blob, bus=None, owner="test", waiting=lambda what: None)


async def test_a_pretrained_policys_samples_are_decoded_with_its_own_tokenizer(tmp_path) -> None:
    from actors.config import PolicySection, RLConfig
    from runtime.blob import open_store
    from tests.actors.agent.test_dialect import PLAIN_TEMPLATE, _checkpoint

    directory = _checkpoint(tmp_path / "policy", PLAIN_TEMPLATE)
    from model.tokenizer import HFTokenizer

    tok = HFTokenizer(directory, end_token="</s>")
    answer = tok.encode(" done</s>")
    stored = tokenized_group_record(directory, "User: hi\nAssistant:", " done</s>")
    views = await _loaded(RLConfig(policy=PolicySection(checkpoint=str(directory))))
    (view,) = views("groups/g1/a0", stored)
    assert [run[0] for run in view["tokens"]] == ["User: hi\nAssistant:", " done</s>"]
    assert view["tokens"][1][5].split(PIECE_SEPARATOR) == [tok.decode([t]) for t in answer] == [" ", "done", "</s>"]
    assert (await _loaded(RLConfig()))("groups/g1/a0", _record())[0]["tokens"][0][0] == "ab", "the tiny policy: bytes"
    async with open_store((tmp_path / "blobs").as_uri()) as blob:  # a finished run that never stored its build
        with pytest.raises(FileNotFoundError, match="is not stored in"):
            await _loaded(RLConfig(policy=PolicySection(pretrained="smollm2-135m-instruct", cache_dir=tmp_path)), blob)
