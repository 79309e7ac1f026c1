"""``python -m ops.dashboard [RUN_DIR] [--host H] [--port P]``: the dashboard of a live or finished run.

Live when the run's bus answers (the same live views as the run's own dashboard actor, as the operator);
otherwise the run's event files, read once (curves and events; no actors, slot table or live keys). A run
whose supervisor said it ended (finished, stopped, failed) is served from its files at once, its bus not
asked: the page says how it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path

import structlog

from ops._client import connect_or_none, fail, resolve_run_dir
from ops.dashboard.feeds import feed_live, load_event_files, run_end, sample_fetcher, set_live_key
from ops.dashboard.model import RunView
from ops.dashboard.prometheus import scrape
from ops.dashboard.server import WebServer, build_app
from runtime.blob import open_store
from runtime.errors import ConfigError
from runtime.run_config import load_run_config
from runtime.rundir import CONFIG_FILE, RunInfo

CONNECT_TIMEOUT_S = 3.0


async def serve(run_dir: Path, host: str, port: int, sample_s: float) -> None:
    view = RunView(run_dir.name)
    info = RunInfo.read(run_dir)
    config = load_run_config([run_dir / CONFIG_FILE], import_actors=False)  # no actor code (torch) to import
    settings = config.runtime.dashboard
    async with open_store(info.storage_url, s3_endpoint=info.s3_endpoint or None) as blob:
        end = run_end(run_dir, info.started_at)
        bus, reason = (None, "") if end is not None else await connect_or_none(run_dir, "ops-dashboard",
                                                                              CONNECT_TIMEOUT_S)
        samples = sample_fetcher(settings, blob, config.app, bus=bus, owner="ops-dashboard")
        shelf = samples.shelf if samples else None
        if bus is None:
            view.live, view.ended = False, end.outcome if end is not None else None
            num_events = load_event_files(run_dir, view, samples)
            why = (f"run {info.run} {end.outcome} at {end.at:%Y-%m-%d %H:%M:%S}Z" if end is not None else
                   f"the run's bus does not answer ({reason})")
            print(f"ops.dashboard: {why}; showing the {num_events} events under {run_dir / 'logs'} (not live)",
                  file=sys.stderr)
            app = build_app(view, shelf=shelf)
        else:
            app = build_app(view, lambda key, raw: set_live_key(bus, run_dir, key, raw),
                            lambda: scrape(bus, info.run, config.runtime.run.name), shelf)
        server = WebServer(app, host, port)
        print(f"dashboard  {await server.start()}", flush=True)
        try:
            if bus is None:  # a finished run's view changes no more once its kept samples are read
                await (samples.run() if samples else asyncio.Event().wait())
            else:
                await feed_live(bus, view, sample_s, samples)
        finally:
            await server.stop()
            if bus is not None:
                await bus.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", type=Path, help="a run directory (default: the newest under runs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8322, help="port (0: any free port)")
    p.add_argument("--sample-s", type=float, default=2.0, help="status samples this often (live runs)")
    args = p.parse_args(argv)
    # this process's own library events go to stderr, warnings and worse: stdout says where it serves
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        run_dir = resolve_run_dir(args.run_dir)
    except ConfigError as e:
        return fail(str(e))
    if not run_dir.is_dir():
        return fail(f"{run_dir} is not a directory; pass a run directory made by python -m runtime.up")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(run_dir, args.host, args.port, args.sample_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
