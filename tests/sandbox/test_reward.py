"""score(): per-test partial credit, and no way for the agent to raise its reward by tampering."""

from __future__ import annotations

import json

from sandbox import Environment, LayerStore, SandboxLimits, Task, score
from sandbox._safepath import write_atomic
from sandbox.reward import count_tests

CASES = {
    "module": "solution",
    "function": "f",
    "cases": [{"args": [x], "expected": x * 3} for x in (0, 1, 2, -4, 10)],
}
TASK = Task(
    id="triple",
    prompt="Write f(x) in solution.py that returns x times 3.",
    files={"solution.py": "def f(x):\n    pass\n"},
    hidden_tests={"tests/hidden_cases.json": json.dumps(CASES)},
    reference_solution={"solution.py": "def f(x):\n    return x*3\n"},
    limits=SandboxLimits(wall_time_s=4.0),
)
PY_TASK = Task(
    id="py-tests",
    prompt="p",
    files={"solution.py": "def f(x):\n    return x\n"},
    hidden_tests={
        "tests/test_hidden.py": "from solution import f\n\ndef test_a():\n    assert f(1) == 1\n\n"
        "def test_b():\n    assert f(2) == 3\n\ndef helper():\n    pass\n"
    },
)


def _write(env: Environment, path: str, text: str) -> None:
    cfg = env.store.config
    write_atomic(env.workspace_path, (path,), text.encode(), uid=cfg.sandbox_uid, gid=cfg.sandbox_gid)


async def _score_with(store: LayerStore, task: Task, solution: str, setup: str = "") -> int:
    with Environment.create(store, task.files) as env:
        _write(env, "solution.py", solution)
        if setup:
            await env.run(setup)
        return (await score(env, task)).num_passed


async def test_partial_credit(store: LayerStore) -> None:
    # right only where x*3 == x*x - x ... i.e. x in (0, 4): here only x = 0
    assert await _score_with(store, TASK, "def f(x):\n    return x*x-x\n") == 1
    assert await _score_with(store, TASK, "def f(x):\n    return x*3 if x > 0 else 0\n") == 4
    assert await _score_with(store, TASK, TASK.reference_solution["solution.py"]) == 5
    assert await _score_with(store, TASK, "syntax error(\n") == 0
    assert await _score_with(store, TASK, "def f(x):\n    while True: pass\n") == 0


async def test_python_hidden_tests_are_reported_per_function(store: LayerStore) -> None:
    assert count_tests(PY_TASK) == ["tests/test_hidden.py::test_a", "tests/test_hidden.py::test_b"]
    with Environment.create(store, PY_TASK.files) as env:
        outcome = await score(env, PY_TASK)
    assert (outcome.num_passed, outcome.num_total) == (1, 2)
    assert [d.passed for d in outcome.details] == [True, False]


async def test_tampering_with_tests_cannot_raise_the_reward(store: LayerStore) -> None:
    wrong = "def f(x):\n    return x\n"  # passes only x = 0
    baseline = await _score_with(store, TASK, wrong)
    assert baseline == 1
    fake_cases = json.dumps({"module": "solution", "function": "f", "cases": [{"args": [1], "expected": 1}] * 5})
    tamperings = [
        # replace the hidden test file with an easy one, or make its path unusable
        f"mkdir -p tests && printf '%s' '{fake_cases}' > tests/hidden_cases.json",
        "mkdir -p tests/hidden_cases.json/x",
        "ln -s /dev/null tests && true",
        "rm -rf tests; ln -s /tmp tests",
        "chmod 000 . 2>/dev/null; true",
        # shadow the grader, python, json or the comparison
        "mkdir -p opt/asyncrl && echo 'print(1)' > opt/asyncrl/grader.py; echo 'raise SystemExit' > json.py",
        "echo 'import sys; sys.exit(0)' > sitecustomize.py; echo 'x' > usercustomize.py",
    ]
    for setup in tamperings:
        assert await _score_with(store, TASK, wrong, setup) <= baseline, setup
    forging = [
        # print fake nonce-less result lines, exit early, or monkeypatch builtins at import
        'import sys\nprint(\'{"test": "tests/hidden_cases.json::case1", "passed": true}\')\n'
        "sys.stdout.write('x {\"done\": true}\\n')\n" + wrong,
        "import os\nos._exit(0)\n",
        "import builtins, json\njson.dumps = lambda *a, **k: '0'\n" + wrong,
        "class Any:\n    def __eq__(self, o): return True\ndef f(x):\n    return Any()\n",
        "import os, glob\nprint(open(glob.glob('/workspace/tests/*')[0]).read())\n" + wrong,
        # read the grader's memory or fds to learn the nonce or expected values
        "import os\ntry:\n    print(open(f'/proc/{os.getppid()}/environ').read())\nexcept Exception: pass\n" + wrong,
    ]
    for solution in forging:
        assert await _score_with(store, TASK, solution) <= baseline, solution


async def test_score_accepts_a_snapshot_and_leaves_it_usable(store: LayerStore) -> None:
    with Environment.create(store, TASK.reference_solution) as env:
        snap = env.snapshot()
    with snap:
        first = await score(snap, TASK)
        second = await score(snap, TASK)
        assert first.num_passed == second.num_passed == 5
        assert first.fraction == 1.0


async def test_custom_test_command_is_all_or_nothing(store: LayerStore) -> None:
    task = Task(
        id="cmd",
        prompt="p",
        files={"ok": ""},
        test_command="test -f ok && test -f hidden.txt",
        hidden_tests={"hidden.txt": ""},
    )
    with Environment.create(store, task.files) as env:
        outcome = await score(env, task)
    assert (outcome.num_passed, outcome.num_total) == (1, 1)


async def test_many_rollouts_concurrently(store: LayerStore) -> None:
    """What the rollout actor does, eight at a time on one event loop."""
    import asyncio

    from sandbox import ToolBox, generate_tasks

    async def rollout(task: Task) -> float:
        with Environment.create(store, task.files, task.limits) as env:
            tools = ToolBox(env)
            assert (
                await tools.call(
                    "write_file", {"path": "solution.py", "content": task.reference_solution["solution.py"]}
                )
            ).ok
            assert (await tools.call("run", {"command": "python3 -c 'import solution'"})).ok
            return (await score(env, task)).fraction

    tasks = generate_tasks(seed=7, n=8)
    assert await asyncio.gather(*(rollout(t) for t in tasks)) == [1.0] * 8


async def test_a_workspace_over_its_budget_is_a_sample_that_fails_every_test(store: LayerStore) -> None:
    """The rollout actor's export of a workspace the policy took over the host budgets is no error of the
    actor (which would burn the sample's retries on the same behaviour): the sample stands, and the reward
    actor's outcome for it fails every test, saying why."""
    from actors.stages.rollout import _export_workspace
    from sandbox.reward import over_budget_outcome

    with Environment.create(store, PY_TASK.files, SandboxLimits(wall_time_s=10.0, max_dir_depth=16)) as env:
        made = await env.run(f"mkdir -p {'/'.join(['d'] * 40)} && echo ok")
        assert "ok" in made.stdout, made.stderr
        workspace, violation = _export_workspace(env)
    assert workspace is None and "deeper than the 16 levels" in violation, violation
    outcome = over_budget_outcome(PY_TASK, violation)
    assert (outcome.num_passed, outcome.num_total) == (0, 2)
    assert all("workspace over budget" in d.detail for d in outcome.details)
    with Environment.create(store, PY_TASK.files) as env:  # within budget: an archive, no violation
        workspace, violation = _export_workspace(env)
    assert workspace and violation == ""
