"""Hidden-test runner executed INSIDE the sandbox (stdlib only; never imported by the host).

Bound read-only outside the workspace. The parent process never imports agent code: it reads its
instructions (a nonce, the hidden test paths) from stdin, loads the hidden tests and deletes them
from the workspace, makes itself non-dumpable (so agent processes cannot read its memory or fds
through /proc), then runs agent code only in child processes whose stdout is a private pipe.
Only the parent writes to the sandbox's stdout, each result line prefixed by the nonce.

Test kinds:
  *.json  I/O cases {"module", "function", "cases": [{"args": [...], "expected": ...}]}: the child
          only receives the arguments and returns outputs; the parent, which alone knows the
          expected values, compares them. A solution cannot fake a pass.
  *.py    assert-style modules; each top-level ``test_*`` function runs in its own child and
          passes if the child exits 0 (a hostile solution could exit(0) early: prefer *.json).
"""

import ast
import contextlib
import ctypes
import json
import os
import subprocess
import sys

_DETAIL_CHARS = 300


def _undumpable():
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def _canon(value):
    return json.dumps(value, sort_keys=True)


def _child(mode, payload, timeout_s):
    proc = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    try:
        out, _ = proc.communicate(json.dumps(payload).encode(), timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        timed_out = True
    return proc.returncode, out[: 1 << 20].decode("utf-8", "replace"), timed_out


def _run_cases(rel, spec, workspace, timeout_s):
    cases = spec["cases"]
    payload = {
        "module": spec.get("module", "solution"),
        "function": spec["function"],
        "args": [case["args"] for case in cases],
        "workspace": workspace,
    }
    _, out, timed_out = _child("--call", payload, timeout_s)
    got = {}
    for line in out.splitlines():
        try:
            row = json.loads(line)
            got[int(row["i"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    for i, case in enumerate(cases):
        row = got.get(i)
        if row is None:
            passed, detail = False, "timed out" if timed_out else "no result (crashed?)"
        elif "error" in row:
            passed, detail = False, str(row["error"])
        else:
            passed = "out" in row and _canon(row["out"]) == _canon(case["expected"])
            detail = "" if passed else f"wrong output for args {_canon(case['args'])}: {_canon(row.get('out'))}"
        yield f"{rel}::case{i}", passed, detail


def _run_module(rel, source, workspace, timeout_s):
    names = [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    ]
    for name in names:
        payload = {"source": source, "filename": rel, "function": name, "workspace": workspace}
        code, _, timed_out = _child("--pytest", payload, timeout_s)
        detail = "timed out" if timed_out else ("" if code == 0 else f"exit code {code}")
        yield f"{rel}::{name}", code == 0 and not timed_out, detail


def _parent():
    request = json.loads(sys.stdin.read())
    nonce, workspace = request["nonce"], request["workspace"]
    loaded = []
    for rel in request["files"]:
        path = os.path.join(workspace, rel)
        with open(path, encoding="utf-8") as f:
            loaded.append((rel, f.read()))
        os.unlink(path)
    _undumpable()
    for rel, text in loaded:
        run = _run_cases if rel.endswith(".json") else _run_module
        try:
            spec = json.loads(text) if rel.endswith(".json") else text
            for name, passed, detail in run(rel, spec, workspace, request["timeout_s"]):
                _report(nonce, {"test": name, "passed": bool(passed), "detail": detail[:_DETAIL_CHARS]})
        except Exception as e:  # a malformed hidden test file: report, do not crash the grader
            _report(nonce, {"test": rel, "passed": False, "detail": f"grader error: {e}"[:_DETAIL_CHARS]})
    _report(nonce, {"done": True})


def _report(nonce, row):
    sys.stdout.write(nonce + " " + json.dumps(row) + "\n")
    sys.stdout.flush()


def _enter_workspace(workspace):
    real = os.dup(1)
    os.dup2(2, 1)
    os.chdir(workspace)
    sys.path.insert(0, workspace)
    return os.fdopen(real, "w")


def _call():
    spec = json.loads(sys.stdin.read())
    out = _enter_workspace(spec["workspace"])
    try:
        module = __import__(spec["module"])
        fn = getattr(module, spec["function"])
    except BaseException as e:
        for i in range(len(spec["args"])):
            out.write(json.dumps({"i": i, "error": f"import failed: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    for i, args in enumerate(spec["args"]):
        try:
            line = json.dumps({"i": i, "out": fn(*args)})
        except BaseException as e:
            line = json.dumps({"i": i, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        out.write(line + "\n")
        out.flush()


def _pytest():
    spec = json.loads(sys.stdin.read())
    _enter_workspace(spec["workspace"])
    namespace = {"__name__": "hidden_test", "__file__": spec["filename"]}
    exec(compile(spec["source"], spec["filename"], "exec"), namespace)
    namespace[spec["function"]]()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    {"--call": _call, "--pytest": _pytest}.get(sys.argv[1] if len(sys.argv) > 1 else "", _parent)()
