"""``python -m ops.docs``: regenerate the documentation site's generated pages; ``--check``: only say which are stale.

``--check`` exits 1 naming each stale page (tests/docs runs the same check), 0 when all are current.
"""

from __future__ import annotations

import argparse
import sys

from ops.docs.pages import DOCS, generate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated page is stale")
    args = p.parse_args(argv)
    outcome = generate(DOCS, check=args.check)
    for stale in outcome.stale:
        print(f"{'stale' if args.check else 'written'}: docs/{stale}", file=sys.stderr if args.check else sys.stdout)
    if args.check and outcome.stale:
        print("run python -m ops.docs to regenerate them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
