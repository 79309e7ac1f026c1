"""The dashboard as an actor of the run: supervised, restarted and placed like every other kind.

A run file that names it (``[actors.dashboard] entry = "ops.dashboard.actor:DashboardActor"``; the
embedded default does) gets a live dashboard for as long as the run is up, at the ``[dashboard]``
section's address. Its URL is in its registry entry (``ops.status``) and on ``progress.dashboard``,
which ``runtime.up`` prints. It consumes no work queue: it reads the event log, the registry, the
status of the reconciler and trainer and the live configuration, and writes live keys.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import msgpack

from ops.dashboard.feeds import feed_live, sample_fetcher, set_live_key
from ops.dashboard.model import RunView
from ops.dashboard.prometheus import scrape
from ops.dashboard.server import WebServer, build_app
from runtime.actor import Actor
from runtime.bus_auth import BusAccess, stream_reader
from runtime.run_config import load_run_config
from runtime.rundir import CONFIG_FILE


class DashboardActor(Actor):
    kind = "dashboard"
    bus_access = BusAccess(publish=("ctl.*.*.status", "ctl.*.*.metrics", "ctl.supervisor.status", "progress.dashboard"),
                           subscribe=("log.>",), kv_read=("actors",), kv_write=("config",)) \
        | stream_reader("LOG", "log.>")

    async def setup(self) -> None:
        run_dir = Path(self.ctx.run_dir)
        config = load_run_config([run_dir / CONFIG_FILE], import_actors=False)  # no actor code (torch) to import
        self.settings_ = config.runtime.dashboard
        self.view = RunView(self.ctx.run.name if self.ctx.run else run_dir.name)
        # the viewer's views may wait for the run (its policy's build): in `background`, never in the start
        self.samples = sample_fetcher(self.settings_, self.ctx.blob, config.app, bus=self.bus,
                                      owner=self.ctx.identity.actor_id)
        app = build_app(self.view, lambda key, raw: set_live_key(self.bus, run_dir, key, raw),
                        lambda: scrape(self.bus, self.ctx.run_id, self.view.run_name),
                        self.samples.shelf if self.samples else None)
        self.server = await self._listen(app)
        self.exit_stack.push_async_callback(self.server.stop)
        self._log.info("dashboard_serving", url=self.server.url)

    async def _listen(self, app: Any) -> WebServer:
        """The configured port, or any free one if another process has it (two runs on one machine)."""
        cfg = self.settings_
        server = WebServer(app, cfg.host, cfg.port)
        try:
            await server.start()
        except OSError as e:
            if e.errno != errno.EADDRINUSE or cfg.port == 0:
                raise
            await server.stop()
            self._log.warning("dashboard_port_taken", port=cfg.port, fix="set dashboard.port; taking a free port")
            server = WebServer(app, cfg.host, 0)
            await server.start()
        return server

    async def background(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.publish("progress.dashboard", msgpack.packb({"dashboard": self.server.url}))
        tg.create_task(feed_live(self.bus, self.view, self.settings_.sample_s, self.samples), name="dashboard-feeds")

    def status(self) -> dict[str, Any]:
        server = getattr(self, "server", None)
        view = getattr(self, "view", None)
        samples = getattr(self, "samples", None)
        return {"url": server.url if server else "", "num_viewers": view.num_subscribers if view else 0,
                "sample_viewer": samples.state if samples else "off",
                "num_kept_groups": samples.shelf.num_groups if samples else 0,
                "num_samples_skipped": samples.num_skipped if samples else 0,
                "num_samples_unreadable": samples.num_unreadable if samples else 0}
