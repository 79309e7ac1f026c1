"""Render a run's learning curve from its metrics: ``python -m ops.plot RUN_DIR [RUN_DIR ...] --out FILE``.

Held-out pass@1 (at the evaluator's temperature) against wall-clock minutes for each run, with the
training reward beside it; several runs (seeds) are drawn on the same axes. The rows come from each
run's blob store, found through its directory's run.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from ops._client import fail
from runtime import metrics_log


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of the run of ``run_dir`` (its store, found through run.json), as the evaluator reads them.

    Raises:
        ConfigError: ``run_dir`` is not a run directory.
        FileNotFoundError: the run has no rows yet.
    """
    rows = asyncio.run(metrics_log.read_run_metrics(run_dir))
    if not rows:
        raise FileNotFoundError(f"the run of {run_dir} has no metrics in its store yet")
    return rows


def _eval_title(evals: list[dict[str, Any]]) -> str:
    temperatures = {r.get("temperature") for r in evals}
    if len(temperatures) != 1 or None in temperatures:
        return "held-out pass@1"
    (t,) = temperatures
    return "held-out pass@1 (greedy)" if t == 0 else f"held-out pass@1 (temperature {t:g})"


def render(runs: list[Path], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_reward) = plt.subplots(1, 2, figsize=(11, 4))
    all_evals: list[dict[str, Any]] = []
    for run_dir in runs:
        rows = read_metrics(run_dir)
        start = min(r["time"] for r in rows)
        evals = [r for r in rows if r["kind"] == "eval"]
        all_evals += evals
        train = [r for r in rows if r["kind"] == "train"]
        label = run_dir.name
        ax_eval.plot([(r["time"] - start) / 60 for r in evals], [100 * r["pass_at_1"] for r in evals],
                     marker="o", label=label)
        ax_reward.plot([r["version"] for r in train], [r["reward_mean"] for r in train], alpha=0.8, label=label)
    ax_eval.set(xlabel="minutes since the run started", ylabel="held-out pass@1 (%)", title=_eval_title(all_evals))
    ax_reward.set(xlabel="policy version", ylabel="mean reward", title="training reward")
    for ax in (ax_eval, ax_reward):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.plot", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("learning_curve.png"))
    p.add_argument("--title", default="asyncrl default run")
    args = p.parse_args(argv)
    try:
        print(render(args.runs, args.out, args.title))
    except (FileNotFoundError, ValueError, KeyError) as e:
        return fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
