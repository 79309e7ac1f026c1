"""A process for the zygote tests: ``python -m tests.runtime.zygote_child EXIT_CODE`` prints what a test checks
(its parent, session, arguments, one variable of its environment and torch's threads), then exits with
EXIT_CODE, or, given ``wait``, waits to be signalled."""

from __future__ import annotations

import json
import os
import signal
import sys

if __name__ == "__main__":
    torch = sys.modules.get("torch")
    print(json.dumps({"ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv[1:],
                      "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "name": __name__,
                      "threads": torch.get_num_threads() if torch is not None else None}), flush=True)
    if sys.argv[1] == "wait":
        signal.pause()
    sys.exit(int(sys.argv[1]))
