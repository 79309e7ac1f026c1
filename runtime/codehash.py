"""The content hash of the code a process runs: every loaded module of the project and the actor's own."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def code_hash(extra_roots: tuple[Path, ...] = ()) -> str:
    """sha256 over (path, bytes) of every loaded module file under the project or ``extra_roots``.

    Computed after the actor's class is imported, so it covers exactly the code that will run.
    """
    roots = tuple(r.resolve() for r in (PROJECT_ROOT, *extra_roots))
    files: set[Path] = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        resolved = Path(path).resolve()
        if ".venv" in resolved.parts or "site-packages" in resolved.parts or not resolved.is_file():
            continue  # installed packages, and modules with made-up paths (torch._classes)
        if any(resolved.is_relative_to(r) for r in roots):
            files.add(resolved)
    digest = hashlib.sha256()
    for f in sorted(files):
        digest.update(str(f.relative_to(_root_of(f, roots))).encode())
        digest.update(b"\0")
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _root_of(path: Path, roots: tuple[Path, ...]) -> Path:
    return next(r for r in roots if path.is_relative_to(r))
