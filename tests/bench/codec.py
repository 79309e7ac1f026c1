"""CPU cost of the codec per message: encode and decode microseconds, msgspec vs the hand-written peer.

The messages are the real ones: work orders and completions on the wire (runtime.codec, envelope and
all), and the records stored in blob storage (actors.records: a rollout's trajectory record, a group
record of 8 such samples), at the default run's sizes (a 640-token episode, the default policy's router
choices).

Peers, in the same process, on the same objects:
- wire messages: msgpack + a hand-written dataclass validator (kept here whole, caches of type hints
  and fields included);
- records untyped: msgpack of plain maps on write, and on read msgpack then ``Trajectory.from_dict`` (for
  the reward actor) or nothing at all (grouping and the trainer indexing the maps): no validation.

Prints one JSON line: microseconds per encode and decode for each message and peer, and the ratios
(peer / msgspec: above 1 means msgspec is faster). Medians over repeats, the peers' trials interleaved.

Run: .venv/bin/python -m tests.bench.codec [--repeats 7] [--min-time-s 0.2]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import os
import statistics
import time
import types
import typing
from collections.abc import Callable, Coroutine
from typing import Any

import msgpack
import numpy as np
import torch

from actors.agent.trajectory import EpisodeEnd, Segment, ToolUse, Trajectory
from actors.messages import COMPLETION_TYPES, all_order_types
from actors.reconciler.slot import Stage
from actors.reconciler.work import (
    GroupDone,
    GroupOrder,
    RewardOrder,
    RolloutDone,
    RolloutOrder,
    StageFailed,
    TrainDone,
    TrainOrder,
)
from actors.records import GroupRecord, GroupSample, RewardBreakdown, RolloutRecord, decode_record, encode_record
from model.config import ModelConfig
from runtime.codec import SCHEMA_VERSION, Codec


# --- the peer: a hand-written validator, without msgspec ---------------------------------------------
class HandCodec:
    """msgpack envelope and body, validated field by field against the dataclass's type hints."""

    def __init__(self, types_: dict[str, type]) -> None:
        self._types = dict(types_)
        self._names = {t: n for n, t in types_.items()}

    def encode(self, msg: Any) -> bytes:
        name = self._names[type(msg)]
        body = msgpack.packb(_to_wire(msg), use_bin_type=True)
        return msgpack.packb({"schema": SCHEMA_VERSION, "type": name, "v": 1, "body": body}, use_bin_type=True)

    def decode(self, data: bytes) -> Any:
        env = msgpack.unpackb(data, raw=False)
        if not isinstance(env, dict) or env.get("schema") != SCHEMA_VERSION:
            raise ValueError("not an envelope")
        name = env.get("type")
        cls = self._types.get(name) if isinstance(name, str) else None
        if cls is None or env.get("v") != 1:
            raise ValueError(f"unknown type {name!r}")
        return _from_wire(cls, msgpack.unpackb(env["body"], raw=False), name)


@functools.cache
def _wire_fields(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Any, bool], ...]]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    missing = dataclasses.MISSING
    return frozenset(f.name for f in fields if f.init), tuple(
        (f.name, hints[f.name], f.default is missing and f.default_factory is missing) for f in fields)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _to_wire(msg: Any) -> Any:
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {name: _to_wire(getattr(msg, name)) for name in _field_names(type(msg))}
    if isinstance(msg, enum.Enum):
        return msg.value
    if isinstance(msg, tuple | list):
        return [_to_wire(x) for x in msg]
    if isinstance(msg, dict):
        return {k: _to_wire(v) for k, v in msg.items()}
    return msg


def _from_wire(cls: type, fields: Any, path: str) -> Any:
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: expected a map")
    names, wire_fields = _wire_fields(cls)
    if set(fields) - names:
        raise ValueError(f"{path}: unknown fields")
    kwargs = {}
    for name, hint, required in wire_fields:
        if name in fields:
            kwargs[name] = _check(fields[name], hint, f"{path}.{name}")
        elif required:
            raise ValueError(f"{path}: missing field {name!r}")
    return cls(**kwargs)


def _check(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, path)
            except ValueError:
                continue
        raise ValueError(f"{path}: {value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return _from_wire(hint, value, path)
    if origin is tuple or origin is list:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{path}: expected a list")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        items = [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        kt, vt = typing.get_args(hint) or (Any, Any)
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a map")
        return {_check(k, kt, path): _check(v, vt, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and hint in (int, float, str, bytes, bool):
        if type(value) is not hint:
            raise ValueError(f"{path}: expected {hint.__name__}")
        return value
    raise ValueError(f"{path}: unsupported field type {hint}")


# --- the peer for records: plain maps, untyped -------------------------------------------------------
def _segment_to_dict(s: Segment) -> dict[str, Any]:
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    topk = s.topk_ids_TLK
    d["topk_ids_TLK"] = {"shape": list(topk.shape), "data": topk.tobytes()}
    return d


def _segment_from_dict(d: dict[str, Any]) -> Segment:
    d = dict(d)
    topk = d["topk_ids_TLK"]
    d["topk_ids_TLK"] = np.frombuffer(topk["data"], dtype=np.int16).reshape(topk["shape"]).copy()
    return Segment(**d)


def _trajectory_to_dict(t: Trajectory) -> dict[str, Any]:
    d = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
    d["end"] = t.end.value
    d["tool_uses"] = [dataclasses.asdict(u) for u in t.tool_uses]
    d["segments"] = [_segment_to_dict(s) for s in t.segments]
    return d


def _trajectory_from_dict(d: dict[str, Any]) -> Trajectory:
    d = dict(d)
    d["end"] = EpisodeEnd(d["end"])
    d["tool_uses"] = [ToolUse(**u) for u in d["tool_uses"]]
    d["segments"] = [_segment_from_dict(s) for s in d["segments"]]
    return Trajectory(**d)


def _rollout_as_map(r: RolloutRecord) -> dict[str, Any]:
    return {"sample_id": r.sample_id, "prompt_id": r.prompt_id, "trajectory": _trajectory_to_dict(r.trajectory)}


def _group_as_map(g: GroupRecord) -> dict[str, Any]:
    return {"schema": 1, "group_id": g.group_id, "prompt_id": g.prompt_id, "min_version": g.min_version,
            "max_version": g.max_version, "created_at": g.created_at,
            "samples": [{"sample_id": s.sample_id, "reward": s.reward, "components": dataclasses.asdict(s.components),
                         "advantage": s.advantage, "trajectory": _trajectory_to_dict(s.trajectory)}
                        for s in g.samples]}


# --- the messages -----------------------------------------------------------------------------------
def trajectory(num_tokens: int, seed: int) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig()
    prompt = num_tokens // 4
    return Trajectory([Segment(
        token_ids=torch.randint(0, 256, (num_tokens,), generator=g).tolist(),
        loss_mask=[0] * prompt + [1] * (num_tokens - prompt),
        behaviour_logprobs=(-torch.rand(num_tokens, generator=g)).tolist(),
        logprob_temperatures=[1.0] * num_tokens,
        versions=[-1] * prompt + [3] * (num_tokens - prompt),
        topk_ids_TLK=torch.randint(0, cfg.num_experts, (num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok),
                                   generator=g, dtype=torch.int16).numpy(),
        prompt_len=prompt)], end=EpisodeEnd.FINAL_ANSWER,
        tool_uses=[ToolUse("write_file", True, False, 12)], num_turns=2, num_tool_call_tokens=60,
        num_tool_output_tokens=12, num_final_tokens=5, num_thinking_tokens=40, duration_s=1.5, generate_s=1.2,
        tools_s=0.2)


def wire_messages() -> dict[str, Any]:
    keys = tuple(f"samples/e0-p1-s{i}/a0/reward-a0" for i in range(8))
    sample_ids = tuple(f"e0-p1-s{i}" for i in range(8))
    return {
        "order.rollout": RolloutOrder("e0-p1-s3", 0, "p1", "e0-p1", 3, 7, "tok-3f2a"),
        "order.reward": RewardOrder("e0-p1-s3", 0, "p1", "e0-p1", "samples/e0-p1-s3/a0", "tok-3f2a"),
        "order.group": GroupOrder("e0-p1", 0, "p1", sample_ids, keys, "tok-3f2a"),
        "order.train": TrainOrder("b12", 0, tuple(f"e0-p{i}" for i in range(8)),
                                  tuple(f"groups/e0-p{i}/a0" for i in range(8)),
                                  tuple(f"e0-p{i}-s{j}" for i in range(8) for j in range(8)), 12, 13, "tok-3f2a"),
        "done.rollout": RolloutDone("e0-p1-s3", 0, "samples/e0-p1-s3/a0", 6, 7, "tok-3f2a"),
        "done.group": GroupDone("e0-p1", 0, "groups/e0-p1/a0", "tok-3f2a"),
        "done.train": TrainDone("b12", 0, 13, "tok-3f2a"),
        "done.failed": StageFailed(Stage.REWARD, "e0-p1-s3", 0, "workspace missing", "tok-3f2a"),
    }


def records(num_tokens: int) -> dict[str, Any]:
    rollout = RolloutRecord("e0-p1-s0", "p1", trajectory(num_tokens, 0))
    breakdown = RewardBreakdown(1.0, 3, 3, 130.0, 0.0, 0, 0.0, 1.0)
    samples = tuple(GroupSample(f"e0-p1-s{i}", 1.0, breakdown, 0.125, trajectory(num_tokens, i)) for i in range(8))
    return {"record.trajectory": rollout, "record.group": GroupRecord("e0-p1", "p1", 3, 3, 1.7e9, samples)}


# --- timing -----------------------------------------------------------------------------------------
def per_call_us(fn: Callable[[], Any], min_time_s: float) -> float:
    n, elapsed = 1, 0.0
    while True:
        started = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - started
        if elapsed >= min_time_s:
            return elapsed / n * 1e6
        n *= 2


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """A coroutine that never waits (no blob store: inline bodies only), run without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the codec waited: this benchmark measures inline messages only")


def medians_us(fns: dict[str, Callable[[], Any]], args: argparse.Namespace) -> dict[str, float]:
    """Median microseconds per call of each of ``fns``, their trials interleaved in alternating order, so
    that a change in the machine's load falls on every peer alike."""
    trials: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(args.repeats):
        for name in list(fns) if r % 2 == 0 else reversed(list(fns)):
            trials[name].append(per_call_us(fns[name], args.min_time_s))
    return {name: statistics.median(t) for name, t in trials.items()}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    types_ = {**all_order_types(), **COMPLETION_TYPES}
    codec, hand = Codec(types_), HandCodec(types_)
    encode = lambda msg: _run(codec.encode(msg))  # noqa: E731
    decode = lambda data: _run(codec.decode(data))  # noqa: E731
    rows: dict[str, Any] = {}
    for name, msg in wire_messages().items():
        wire, old = encode(msg), hand.encode(msg)
        assert decode(wire) == msg and hand.decode(old) == msg and hand.decode(wire) == msg
        rows[name] = {"bytes": len(wire), **medians_us({
            "msgspec_encode_us": lambda m=msg: encode(m), "hand_encode_us": lambda m=msg: hand.encode(m),
            "msgspec_decode_us": lambda w=wire: decode(w), "hand_decode_us": lambda w=old: hand.decode(w)}, args)}
    old_maps = {"record.trajectory": _rollout_as_map, "record.group": _group_as_map}
    old_reads = {"record.trajectory": lambda d: _trajectory_from_dict(msgpack.unpackb(d)["trajectory"]),
                 "record.group": lambda d: msgpack.unpackb(d)}
    for name, record in records(args.num_tokens).items():
        data, cls = encode_record(record), type(record)
        old = msgpack.packb(old_maps[name](record), use_bin_type=True)
        assert encode_record(decode_record(data, cls, name)) == data
        rows[name] = {"bytes": len(data), **medians_us({
            "msgspec_encode_us": lambda r=record: encode_record(r),
            "untyped_encode_us": lambda r=record, f=old_maps[name]: msgpack.packb(f(r), use_bin_type=True),
            "msgspec_decode_us": lambda d=data, c=cls, k=name: decode_record(d, c, k),
            "untyped_decode_us": lambda d=old, f=old_reads[name]: f(d)}, args)}
    for row in rows.values():
        peer = "hand" if "hand_encode_us" in row else "untyped"
        for op in ("encode", "decode"):
            row[f"{op}_ratio"] = round(row[f"{peer}_{op}_us"] / row[f"msgspec_{op}_us"], 2)
        for k, v in row.items():
            if k.endswith("_us"):
                row[k] = round(v, 2)
    wire = [r for n, r in rows.items() if not n.startswith("record.")]
    return {
        "bench": "codec", "repeats": args.repeats, "num_tokens": args.num_tokens,
        "load_1m": round(os.getloadavg()[0], 2),
        "wire_encode_ratio_median": statistics.median(r["encode_ratio"] for r in wire),
        "wire_decode_ratio_median": statistics.median(r["decode_ratio"] for r in wire),
        "messages": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-time-s", type=float, default=0.2)
    parser.add_argument("--num-tokens", type=int, default=640)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(bench(args)), flush=True)


if __name__ == "__main__":
    main()
