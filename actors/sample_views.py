"""How the dashboard's rollout viewer sees the RL trainer's samples (``dashboard.sample_views`` in the run
file names `group_sample_views`): one stored group record in, one JSON-ready view per sample out.

A view carries the sample's tokens as runs of consecutive tokens that share a policy version and a loss
mask (decoded together, so a character split over byte tokens reads whole), each with the mean behaviour
log-prob of its tokens; the reward and its components, the hidden tests, the tool calls, how the episode
ended and the advantage grouping gave it. A chain's segments (self-summarization) follow one another in
``tokens``, each after a separator run (`SEGMENT_BREAK`, version -1, untrained, no tokens). The trainer's
own log-probs are not stored, so they are not shown.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import zstandard

from actors.records import GroupRecord, decode_record
from model.tokenizer import ByteTokenizer

_TOKENIZER = ByteTokenizer()
SEGMENT_BREAK = "\n[context summarized: a new segment]\n"


def group_sample_views(key: str, stored: bytes) -> list[dict[str, Any]]:
    """The views of the samples of the group record stored (zstd-compressed) at ``key``.

    Raises:
        ValueError: a record that does not decompress or is not a group record (`RecordError` says which).
    """
    try:
        data = zstandard.ZstdDecompressor().decompress(stored)
    except zstandard.ZstdError as e:
        raise ValueError(f"group record {key!r} does not decompress: {e}") from None
    record = decode_record(data, GroupRecord, key)
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
                       + _runs(seg.token_ids, seg.versions, seg.loss_mask, seg.behaviour_logprobs)],
        })
    return views


def _runs(token_ids: list[int], versions: list[int], mask: list[int], logprobs: list[float]) -> list[list[Any]]:
    """[text, version, trained (0/1), mean behaviour log-prob, number of tokens] per run of tokens alike."""
    rows = zip(token_ids, versions, mask, logprobs, strict=False)
    runs = []
    for (version, trained), run in itertools.groupby(rows, key=lambda r: (r[1], r[2])):
        run = list(run)
        mean = sum(r[3] for r in run) / len(run) if trained else 0.0
        runs.append([_TOKENIZER.decode([r[0] for r in run]), version, int(trained), mean, len(run)])
    return runs
