"""ops.tail stops on Ctrl-C even when its work swallows the cancellation (nats-py's flush does):
past STOP_GRACE_S the process exits with 130 and says why."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUBBORN = """
import asyncio, os, signal
import ops.tail as tail
tail.STOP_GRACE_S = 1.0

async def stubborn():
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass

async def main():
    asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
    await tail.until_interrupted(stubborn())

asyncio.run(main())
"""


def test_a_tail_whose_work_swallows_the_interrupt_exits_after_the_grace() -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUBBORN], cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 130, done.stderr
    assert "not stopped within 1.0s of the interrupt; exiting" in done.stderr
    assert took >= 1.3, f"exited before the grace ran out: {took:.2f}s"
