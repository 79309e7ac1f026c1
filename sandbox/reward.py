"""Reward = fraction of hidden tests passed, graded in a fresh fork the agent never touched.

`score` freezes the finished workspace (or takes a snapshot), forks it, and only then writes the
hidden tests into the fork (replacing anything the agent left at those paths). The built-in grader
runs outside the agent-writable tree, reports through a nonce-tagged channel only it writes to,
and compares I/O cases itself, so editing, deleting or faking test files cannot raise the reward.
The number of tests is counted on the host from the task, never taken from the sandbox.
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass

import structlog

from sandbox._safepath import split_relpath, write_atomic
from sandbox.env import GRADER_PATH, Environment
from sandbox.errors import SandboxViolation
from sandbox.layers import Snapshot
from sandbox.tasks import Task

__all__ = ["TestCaseResult", "TestOutcome", "count_tests", "score"]

log = structlog.get_logger(__name__)

_PER_CHILD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TestCaseResult:
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class TestOutcome:
    num_passed: int
    num_total: int
    details: tuple[TestCaseResult, ...]

    @property
    def fraction(self) -> float:
        return self.num_passed / self.num_total if self.num_total else 0.0


def count_tests(task: Task) -> list[str]:
    """Names of the tests the task's hidden files define (what the grader must report)."""
    if task.test_command:
        return ["test_command"]
    names = []
    for path in sorted(task.hidden_tests):
        text = task.hidden_tests[path]
        if path.endswith(".check.json"):
            names.append(f"{path}::check")
        elif path.endswith(".json"):
            names += [f"{path}::case{i}" for i in range(len(json.loads(text)["cases"]))]
        else:
            names += [
                f"{path}::{node.name}"
                for node in ast.parse(text).body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
            ]
    return names


def _install_hidden_tests(env: Environment, task: Task) -> None:
    cfg = env.store.config
    for path, text in task.hidden_tests.items():
        parts = split_relpath(path, cfg.workspace_dir)
        write_atomic(env.workspace_path, parts, text.encode(), uid=env.uid, gid=env.gid, force=True)


async def _grade_builtin(env: Environment, task: Task, names: list[str]) -> dict[str, TestCaseResult]:
    nonce = secrets.token_hex(16)
    request = {
        "nonce": nonce,
        "files": sorted(task.hidden_tests),
        # leave the grader time to report after a child times out
        "timeout_s": min(_PER_CHILD_TIMEOUT_S, 0.8 * task.limits.wall_time_s / len(task.hidden_tests)),
        "workspace": env.store.config.workspace_dir,
    }
    result = await env.run(f"exec python3 -I {GRADER_PATH}", stdin=json.dumps(request).encode())
    wanted, reported = set(names), {}
    for line in result.stdout.splitlines():
        tag, _, payload = line.partition(" ")
        if tag != nonce:
            continue
        try:
            row = json.loads(payload)
        except ValueError:
            continue
        name = row.get("test")
        if name in wanted and name not in reported:
            reported[name] = TestCaseResult(name, row.get("passed") is True, str(row.get("detail", "")))
    if len(reported) < len(wanted):
        log.warning(
            "sandbox_grader_incomplete",
            task=task.id,
            exit_code=result.exit_code,
            stderr=result.stderr[-500:],
            timed_out=result.timed_out,
        )
    return reported


def over_budget_outcome(task: Task, reason: str) -> TestOutcome:
    """A workspace over its host budgets fails every one of ``task``'s tests, with the reason as each detail."""
    log.warning("sandbox_workspace_over_budget", task=task.id, reason=reason)
    details = tuple(TestCaseResult(n, False, f"workspace over budget: {reason}") for n in count_tests(task))
    return TestOutcome(0, len(details), details)


async def score(source: Environment | Snapshot, task: Task) -> TestOutcome:
    """Run ``task``'s hidden tests against ``source``'s files in a fresh fork.

    Args:
        source: the finished environment (snapshotted here; it must be idle) or a snapshot.
        task: the task whose hidden tests decide the reward.

    A workspace over its host budgets (`SandboxViolation` from the snapshot: too many bytes,
    files or nested directories) fails every test, with the reason as each test's detail.
    """
    names = count_tests(task)
    try:
        snapshot = source.snapshot() if isinstance(source, Environment) else source
    except SandboxViolation as e:
        return over_budget_outcome(task, str(e))
    try:
        with Environment.fork(snapshot, task.limits) as fork:
            _install_hidden_tests(fork, task)
            if task.test_command:
                run = await fork.run(task.test_command)
                ok = run.exit_code == 0 and not run.timed_out
                reported = {"test_command": TestCaseResult("test_command", ok, f"exit code {run.exit_code}")}
            else:
                reported = await _grade_builtin(fork, task, names)
    finally:
        if snapshot is not source:
            snapshot.release()
    details = tuple(reported.get(n, TestCaseResult(n, False, "not reported")) for n in names)
    outcome = TestOutcome(sum(d.passed for d in details), len(details), details)
    log.info("sandbox_scored", task=task.id, num_passed=outcome.num_passed, num_total=outcome.num_total)
    return outcome
