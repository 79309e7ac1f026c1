"""No wait on the bus or on storage is unbounded: a structural check of every ``await`` in runtime/,
ops/, actors/ and model/weight_sync/ that talks to NATS or to a blob store.

Each such await is bounded in one of these ways, checked here from the source (AST):
  - its own timeout argument (``request``, ``fetch``, ``next_msg``: present and not None);
  - lexically inside ``async with asyncio.timeout(...)`` or the first argument of ``asyncio.wait_for``;
  - its kind's client bound, stated in ``KIND_BOUNDS`` (a JetStream API request times out after the
    context's 5 s, checked below; a core publish, ack or subscribe only writes to the client's
    bounded buffer; a blob call is bounded by the store's timeouts and attempts);
  - the project's own bounded helpers (``HELPERS``), whose insides this same check covers;
  - for calls whose name alone does not tell (a slot store's ``create``, a queue's ``put``), the
    entry of ``LISTED`` for that file and callee.
What fits none of these fails the test, naming file, line and call, as does an unbounded wait
listed in ``UNBOUNDED_BY_DESIGN`` that no longer exists (so the list stays true). Run this module
as a script to print every await with its bound.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nats.js.client import JetStreamContext

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("runtime", "ops", "actors", "model/weight_sync")

TIMEOUT_ARG = {"request": 2, "fetch": None, "next_msg": 0, "flush": 0}  # verb -> positional index of its timeout
REQUIRES_CONTEXT = {"drain"}  # nats-py's drain has no bound of its own: only asyncio.timeout around it
JS_API = "JetStream API request: the context's timeout (5 s)"
NO_WAIT = "core protocol write into the client's bounded pending buffer: no round trip"
BLOB = ("blob store call: the store's connect/read timeouts x max_attempts, and a full file system's wait "
        "max_full_s (runtime.blob)")
KIND_BOUNDS = {
    # JetStream API and KV requests (nats-py sends a request and waits the context's timeout)
    **dict.fromkeys(("stream_info", "streams_info", "add_stream", "update_stream", "add_consumer",
                     "consumer_info", "create_key_value", "keys", "create", "update"), JS_API),
    # core NATS writes: no reply awaited
    **dict.fromkeys(("ack", "nak", "in_progress", "respond", "unsubscribe", "pull_subscribe_bind"), NO_WAIT),
    # blob stores
    **dict.fromkeys(("put_stream", "get_stream", "exists", "list"), BLOB),
}
RECEIVER_BOUNDS = {  # verbs whose bound depends on what they are called on
    "publish": {"nc": NO_WAIT, "js": JS_API},
    "subscribe": {"nc": NO_WAIT, "js": JS_API},  # a JetStream subscribe creates its consumer first
    "put": {"kv": JS_API, "blob": BLOB},
    "get": {"kv": JS_API, "blob": BLOB},
    "delete": {"kv": JS_API, "blob": BLOB},
}
HELPERS = {
    "connect": "Bus.connect: asyncio.wait_for(connect_timeout_s)",
    "close": "Bus.close: drain under asyncio.timeout; a store's close releases its client",
    "kv": "Bus.kv: JetStream API requests (5 s each)",
    "ensure_queue": "Bus.ensure_queue: JetStream API requests (5 s each)",
    "ensure_base": "Bus.ensure_base: JetStream API requests (5 s each)",
    "publish_durable": "Bus.publish_durable: js.publish, 5 s",
    "confirming_publisher": "Bus.confirming_publisher: a core subscribe to its inbox (no round trip)",
    "dead_letter": "Bus.dead_letter: js.publish, 5 s",
    "watch": "runtime.health.watch: Bus.kv_watch under asyncio.timeout(start_grace_s), then probes with timeouts",
    "start": "NatsServer.start: asyncio.wait_for(start_timeout_s); Actor.start: ensure_queue and a registry "
             "put (JetStream requests), then the kind's setup, whose own awaits this check covers",
    "stop": "NatsServer.stop: wait_for(stop_timeout_s), then SIGKILL; a KV watcher's stop: an unsubscribe",
    "create_multipart": "one S3 request through S3BlobStore._call",
    "request_bus": "ops._client.request: Bus.request(timeout_s=timeout_s)",
    **dict.fromkeys(("kv_get", "kv_put", "kv_create", "kv_cas", "kv_delete"),
                    "Bus.kv_*: one JetStream KV request (5 s), after Bus.kv's"),
    "kv_keys": "Bus.kv_keys: Bucket.keys, stream-info pages (5 s each) and one get per key (5 s each)",
    "kv_watch": "Bus.kv_watch: a stream-info request and direct gets (5 s each), then events as they come, renewed "
                "after an outage",
    "current": "Bucket.current: a stream-info request, direct gets (a read timeout each) and a leader's get (5 s)",
    "ensure_bucket": "Bus.ensure_bucket: JetStream API requests (5 s each)",
    "stream_states": "Bus.stream_states: one JetStream API request (5 s)",
    "pull_consumer": "Bus.pull_consumer: a pull_subscribe_bind (core subscribe, no round trip)",
}
READY_SAMPLES = "ReadySamples.put/get: asyncio.wait_for(CALL_TIMEOUT_S) on each Ray call (runtime.ready_samples)"
SLOT_STORE = "a slot store call: one KV request (JetStream API, 5 s)"
PIPELINE_SYNC = "ChainedKVWriter.flush: asyncio.wait_for(ack_timeout_s) on the acknowledgements"
LISTED = {  # (file, callee as written) -> its bound, where the callee's name alone does not tell
    ("actors/reconciler/table.py", "self._store.create"): SLOT_STORE,
    ("actors/reconciler/table.py", "store.create"): SLOT_STORE,
    ("actors/reconciler/lifecycle.py", "store.create"): SLOT_STORE,
    ("actors/reconciler/task_cursor.py", "store.create"): SLOT_STORE,
    ("actors/reconciler/kv_store.py", "self.get"): SLOT_STORE,
    ("runtime/blob/_base.py", "self.delete"): BLOB,  # BlobStore.delete_prefixes: the store's own delete
    ("actors/reconciler/kv_store.py", "super().get"): SLOT_STORE,
    ("actors/reconciler/kv_store.py", "self.sync"): PIPELINE_SYNC,
    ("actors/reconciler/kv_store.py", "self._writer.flush"): PIPELINE_SYNC,
    ("actors/reconciler/actor.py", "self.store.sync"): PIPELINE_SYNC,
    ("actors/reconciler/actor.py", "store.sync"): PIPELINE_SYNC,
    ("actors/agent/weights_follower.py", "self.subscriber.fetch"):
        "WeightSubscriber.fetch: blob store calls (" + BLOB + ")",
    ("model/weight_sync/publisher.py", "self._encoded.put"): "an asyncio.Queue between encoder and uploader: no I/O",
    ("model/weight_sync/publisher.py", "self._encoded.get"): "an asyncio.Queue between encoder and uploader: no I/O",
    ("model/weight_sync/publisher.py", "put"): "its local put: self._retry.run of one store.put (" + BLOB + ")",
    ("ops/dashboard/feeds.py", "self._pending.get"): "an asyncio.Queue of group keys the event log named: no I/O",
    ("actors/_stage.py", "self.ctx.ready_samples.put"): READY_SAMPLES,
    ("actors/_stage.py", "self.ctx.ready_samples.get"): READY_SAMPLES,
}
UNBOUNDED_BY_DESIGN: dict[tuple[str, str], str] = {
    # (file, verb) -> why it may wait without end; none today (ops.tail --follow waits on Bus.follow,
    # an event stream, under asyncio.timeout(None) only when the operator asked to follow)
}
VERBS = {*TIMEOUT_ARG, *REQUIRES_CONTEXT, *KIND_BOUNDS, *RECEIVER_BOUNDS, *HELPERS, "create", "sync", "run"}


@dataclass(frozen=True)
class Await:
    path: str
    line: int
    verb: str
    callee: str
    call: str
    bound: str | None


def _verb(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name == "create" and "_MultipartUpload" in ast.unparse(func):
        return "create_multipart"
    if name == "run" and "_retry" not in ast.unparse(func):  # an actor's or supervisor's run: not a bus call
        return None
    if name == "request" and isinstance(func, ast.Name):  # ops._client.request(bus, subject, ..., timeout_s)
        return "request_bus"
    return name


def _receiver_kind(call: ast.Call) -> str:
    text = ast.unparse(call.func).lower()
    if ".js." in f".{text}" or text.startswith("js."):
        return "js"
    if "blob" in text or "store" in text:
        return "blob"
    if "kv" in text or "registry" in text or "effects" in text or text.startswith("(await"):
        return "kv"
    return "nc"


def _in_kv_subclass(call: ast.Call, node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """``self.get(...)`` inside a class derived from nats-py's KeyValue (runtime.bus.Bucket)."""
    func = call.func  # self.get(...), not a call on one of its attributes (self._nc.publish(...))
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return False
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.ClassDef):
            return any("KeyValue" in ast.unparse(base) for base in node.bases)
    return False


def _may_be_none(expr: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value is None for n in ast.walk(expr))


def _has_timeout(call: ast.Call, position: int | None) -> bool:
    for kw in call.keywords:
        if kw.arg in ("timeout", "timeout_s"):  # a None anywhere in it (x if y else None) may be unbounded
            return not _may_be_none(kw.value)
    return position is not None and len(call.args) > position


def _bounded_by_context(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.AsyncWith) and any(
                "timeout" in ast.unparse(item.context_expr) and not _may_be_none(item.context_expr)
                for item in node.items):
            return True
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("asyncio.wait_for", "wait_for"):
            return True
    return False


def awaits() -> Iterator[Await]:
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            rel = str(path.relative_to(REPO))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Await) and isinstance(node.value, ast.Call)):
                    continue
                call = node.value
                verb = _verb(call)
                if verb not in VERBS:
                    continue
                yield Await(rel, node.lineno, verb, ast.unparse(call.func), ast.unparse(call)[:100],
                            _bound(rel, verb, call, node, parents))


def _bound(rel: str, verb: str, call: ast.Call, node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    if _bounded_by_context(node, parents):
        return "asyncio.timeout / wait_for around it"
    if (rel, ast.unparse(call.func)) in LISTED:
        return LISTED[(rel, ast.unparse(call.func))]
    if verb == "run" and "_retry" in ast.unparse(call.func):
        return "weight sync's Retry of one blob store call (" + BLOB + "; BlobUnavailable not retried again)"
    if verb in TIMEOUT_ARG:
        if _has_timeout(call, TIMEOUT_ARG[verb]):
            return "its timeout argument"
        return UNBOUNDED_BY_DESIGN.get((rel, verb))
    if verb in RECEIVER_BOUNDS:
        kind = "kv" if _in_kv_subclass(call, node, parents) else _receiver_kind(call)
        return RECEIVER_BOUNDS[verb].get(kind)
    if verb == "create":
        return JS_API if _receiver_kind(call) == "kv" else None
    if verb == "sync":
        return None  # a store's sync must carry its own bound: say which here when one appears
    return KIND_BOUNDS.get(verb) or HELPERS.get(verb)


def test_every_bus_or_storage_await_is_bounded() -> None:
    found = list(awaits())
    assert len(found) > 50, "the scan found too few awaits: is it still reading the packages?"
    unbounded = [f"{a.path}:{a.line}: await {a.call}" for a in found if a.bound is None]
    assert not unbounded, "awaits on the bus or storage without a bound:\n" + "\n".join(unbounded)


def test_the_lists_name_waits_that_exist() -> None:
    found = list(awaits())
    seen = {(a.path, a.verb) for a in found}
    stale = [key for key in UNBOUNDED_BY_DESIGN if key not in seen]
    assert not stale, f"UNBOUNDED_BY_DESIGN lists waits that are gone: {stale}"
    callees = {(a.path, a.callee) for a in found}
    stale = [key for key in LISTED if key not in callees]
    assert not stale, f"LISTED names waits that are gone: {stale}"


def test_the_jetstream_context_bounds_its_requests() -> None:
    """The JS_API bound is real: nats-py's context defaults to a 5 s request timeout and the bus does
    not override it with None."""
    assert inspect.signature(JetStreamContext.__init__).parameters["timeout"].default == 5
    bus_source = (REPO / "runtime" / "bus.py").read_text()
    assert "nc.jetstream()" in bus_source and "jetstream(timeout=None" not in bus_source


def test_the_check_catches_an_unbounded_wait() -> None:
    """The check itself can fail: a request without a timeout and a fetch without one are caught."""
    tree = ast.parse("async def f(nc, sub):\n    await nc.request('s', b'')\n    await sub.fetch(1)\n"
                     "    async with asyncio.timeout(1):\n        await nc.request('s', b'')\n")
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bounds = [_bound("x.py", _verb(n.value), n.value, n, parents)  # type: ignore[arg-type]
              for n in ast.walk(tree) if isinstance(n, ast.Await)]
    assert sorted(map(str, bounds)) == ["None", "None", "asyncio.timeout / wait_for around it"]


if __name__ == "__main__":
    for a in awaits():
        print(f"{a.path}:{a.line}  {a.call}\n    bound: {a.bound}", file=sys.stdout)
