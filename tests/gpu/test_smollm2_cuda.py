"""The smollm2 preset (a pretrained checkpoint upcycled to an MoE, its own chat template, pyfunc tasks, HumanEval
held out) runs on a GPU with only ``policy.device=cuda`` changed: a real run of two versions, evaluated at
both ends, its rollout engine, evaluator and trainer on CUDA. Skipped without CUDA; written to run unchanged
where one exists (``python -m pytest tests/gpu``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.metrics_log import read_run_metrics

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]


def test_the_smollm2_preset_runs_on_cuda_with_only_the_device_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "actors", "--preset", "smollm2", "--quiet", "--run-dir", str(run_dir),
           "--set", "policy.device=cuda", "--set", "run.steps=2", "--set", "eval.every_versions=2",
           "--set", "tasks.num_heldout=8"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = asyncio.run(read_run_metrics(run_dir, kind="eval"))
    assert sorted(r["version"] for r in evals) == [0, 2] and all(r["num_tasks"] == 8 for r in evals)
    devices = {}
    for log in (run_dir / "logs").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "policy_loaded":
                devices[event["kind"]] = event["device"]
    assert set(devices) >= {"rollout", "evaluator", "trainer"}, devices
    assert all(device.startswith("cuda") for device in devices.values()), devices
