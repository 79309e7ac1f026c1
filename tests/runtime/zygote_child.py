"""A process for the zygote tests: ``python -m tests.runtime.zygote_child EXIT_CODE`` prints what a test checks
(its parent, session, arguments, one variable of its environment and torch's threads), then exits with
EXIT_CODE, or, given ``wait``, waits to be signalled; given ``leave``, it exits as an actor may: a thread still
running, an idle thread pool, an exit function, output not flushed, ``sys.exit`` with a message."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


class _TornDown:
    """Says so when the interpreter's teardown collects it (a forked child leaves without one)."""

    def __del__(self) -> None:
        print("torn down", flush=True)


def _leave_busy() -> None:
    _kept = _TornDown()
    globals()["_kept"] = _kept
    atexit.register(lambda: print("exit function ran"))
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its worker now waits for more, until told the interpreter exits
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
    print("not flushed", end="\n")
    sys.exit("a message")


if __name__ == "__main__":
    torch = sys.modules.get("torch")
    print(json.dumps({"ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv[1:],
                      "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "name": __name__,
                      "threads": torch.get_num_threads() if torch is not None else None}), flush=True)
    if sys.argv[1] == "wait":
        signal.pause()
    if sys.argv[1] == "leave":
        _leave_busy()
    sys.exit(int(sys.argv[1]))
