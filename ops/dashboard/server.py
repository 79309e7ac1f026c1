"""The dashboard's web server (aiohttp): one page, a snapshot, a live stream, live configuration.

    GET  /                 the page (static/index.html; its script and the vendored uPlot under /static)
    GET  /api/snapshot     everything the page shows now (JSON)
    GET  /api/stream       server-sent events: a snapshot first, then every update as it happens
    GET  /api/samples      the rollout viewer's kept samples (?sort=latest|reward_high|reward_low&prompt=&failed=1)
    GET  /api/samples/ID   one kept sample whole: its tokens, versions, loss mask, reward, tests, group, and its
                           behaviour and (once trained) trainer log-probs per token
    POST /api/config       {"key": "...", "value": "..."}: a live key, validated as ``ops.config set`` does
    GET  /metrics          every actor's Prometheus metrics, labelled run (its id), run_name, kind, actor (live runs)
    GET  /healthz          200 while the server runs

The stream is event-driven: an update is sent when the run produces it. A browser that cannot keep up
is cut off (it reconnects, with a fresh snapshot) instead of making the server buffer without bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from ops.dashboard.model import RunView, Subscriber
from ops.dashboard.prometheus import CONTENT_TYPE
from ops.dashboard.rollouts import RolloutShelf
from runtime.errors import ConfigError

log = structlog.get_logger()

STATIC_DIR = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies and the browser from closing an idle stream

ConfigSetter = Callable[[str, str], Awaitable[Any]]
Scraper = Callable[[], Awaitable[bytes]]
VIEW_KEY = web.AppKey("view", RunView)
SETTER_KEY = web.AppKey("set_config", object)
SCRAPER_KEY = web.AppKey("scrape", object)
SHELF_KEY = web.AppKey("shelf", object)


async def _index(_: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def _snapshot(request: web.Request) -> web.Response:
    return web.Response(text=_encode(request.app[VIEW_KEY].snapshot()), content_type="application/json")


def _encode(obj: Any) -> str:
    # NaN/inf are real figures here (a skipped step's loss) but JSON.parse refuses them: they go as strings
    return json.dumps(_json_safe(obj), default=str)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


async def _stream(request: web.Request) -> web.StreamResponse:
    view = request.app[VIEW_KEY]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    sub = view.subscribe()
    try:
        await response.write(f"event: snapshot\ndata: {_encode(view.snapshot())}\n\n".encode())
        while not (sub.overflowed.is_set() or sub.closing.is_set()):
            updates = await _next_updates(sub)
            if updates is None:
                await response.write(b": keepalive\n\n")
                continue
            # everything queued goes as one message: a burst (a log storm) costs one write, not thousands
            await response.write(f"event: updates\ndata: {_encode(updates)}\n\n".encode())
        if sub.overflowed.is_set():
            log.info("dashboard_client_cut_off", reason="fell behind", queue=view.limits.subscriber_queue)
        await response.write(b"event: closing\ndata: {}\n\n")
    except ConnectionResetError:
        pass  # the browser went away
    finally:
        view.unsubscribe(sub)
    return response


async def _next_updates(sub: Subscriber) -> list[dict[str, Any]] | None:
    """The queued updates (waiting up to KEEPALIVE_S for the first); [] when the stream is to end; None: idle."""
    closing = asyncio.ensure_future(sub.closing.wait())
    first = asyncio.ensure_future(sub.queue.get())
    try:
        done, _ = await asyncio.wait({closing, first}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
        if not first.done():
            first.cancel()
    if first not in done:
        return [] if closing in done else None
    updates = [first.result()]
    while not sub.queue.empty():
        updates.append(sub.queue.get_nowait())
    return updates


async def _set_config(request: web.Request) -> web.Response:
    setter = request.app[SETTER_KEY]
    if setter is None:
        return web.json_response({"ok": False, "error": "this run is not live: its configuration cannot change"},
                                 status=409)
    try:
        body = await request.json()
        key, raw = str(body["key"]), str(body["value"])
    except (ValueError, KeyError, TypeError):
        return web.json_response({"ok": False, "error": 'send {"key": "section.name", "value": "..."}'}, status=400)
    try:
        value = await setter(key, raw)  # type: ignore[operator]
    except ConfigError as e:
        return web.json_response({"ok": False, "key": key, "error": str(e)}, status=400)
    return web.Response(text=_encode({"ok": True, "key": key, "value": value}), content_type="application/json")


async def _samples(request: web.Request) -> web.Response:
    shelf: RolloutShelf | None = request.app[SHELF_KEY]  # type: ignore[assignment]
    if shelf is None:
        return web.json_response({"samples": [], "note": "this run names no dashboard.sample_views"})
    q = request.query
    try:
        rows = shelf.samples(q.get("sort", "latest"), q.get("prompt", ""), q.get("failed", "") in ("1", "true"),
                             int(q.get("limit", "200")))
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    body = {"samples": rows, "num_groups": shelf.num_groups} | ({"note": shelf.note} if shelf.note else {})
    return web.Response(text=_encode(body),
                        content_type="application/json")


async def _sample(request: web.Request) -> web.Response:
    shelf: RolloutShelf | None = request.app[SHELF_KEY]  # type: ignore[assignment]
    view = shelf.sample(request.match_info["sample_id"]) if shelf is not None else None
    if view is None:
        return web.json_response({"error": "no such sample kept (the viewer keeps a sample of them)"}, status=404)
    return web.Response(text=_encode(view), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    scrape = request.app[SCRAPER_KEY]
    if scrape is None:
        return web.Response(status=404, text="this run is not live: no actor to scrape\n")
    body = await scrape()  # type: ignore[operator]
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(view: RunView, set_config: ConfigSetter | None = None, scrape: Scraper | None = None,
              shelf: RolloutShelf | None = None) -> web.Application:
    """The dashboard of ``view``; without ``set_config`` and ``scrape`` (a finished run) it only shows."""
    app = web.Application()
    app[SHELF_KEY] = shelf
    app[VIEW_KEY] = view
    app[SETTER_KEY] = set_config
    app[SCRAPER_KEY] = scrape
    app.router.add_get("/", _index)
    app.router.add_get("/api/snapshot", _snapshot)
    app.router.add_get("/api/stream", _stream)
    app.router.add_post("/api/config", _set_config)
    app.router.add_get("/api/samples", _samples)
    app.router.add_get("/api/samples/{sample_id}", _sample)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_static("/static", STATIC_DIR)
    return app


class WebServer:
    """The app on a TCP address; ``start`` returns the URL (port 0 picks a free port); ``stop`` ends every
    live stream with a ``closing`` message first, so browsers see a stop, not a broken connection."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._view = app[VIEW_KEY]
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        self._host, self._port = host, port
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        sockets = self._runner.addresses
        host, port = sockets[0][0], sockets[0][1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
        return self.url

    async def stop(self) -> None:
        self._view.close_subscribers()
        await asyncio.sleep(0)  # each stream's handler takes its turn to write its last message
        await self._runner.cleanup()
