"""What storing the trainer's checkpoints in the blob store costs a step: save, upload, fetch; file:// and S3.

The default run's policy (the shipped starting policy) with its Adam moments, saved by ``Learner.save``,
then stored (``actors.training.checkpoint_store.upload_checkpoint``) and fetched into an empty cache
(``download_checkpoint``), on a ``file://`` store and on moto's S3 server (over loopback HTTP: the
protocol's cost, not a network's). Median of ``--trials`` each; prints one JSON line.

    python -m tests.bench.checkpoint_store [--trials 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import torch

from actors.config import TrainerSection
from actors.training.checkpoint_store import download_checkpoint, upload_checkpoint
from actors.training.learner import Learner
from actors.training.starting_policy import SHIPPED_DIR
from model.checkpoint import load_checkpoint
from runtime.blob import open_store
from runtime.blob.testing import MotoServer


def _learner() -> Learner:
    _, model = load_checkpoint(Path(SHIPPED_DIR))
    learner = Learner(model, TrainerSection())
    for p in learner.model.parameters():  # Adam moments as after a step: what a checkpoint carries
        learner.optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                                      "exp_avg_sq": torch.rand_like(p)}
    return learner


async def _trials(url: str, endpoint: str | None, saved: Path, work: Path, trials: int) -> dict[str, float]:
    up, down = [], []
    async with open_store(url, s3_endpoint=endpoint) as store:
        for i in range(trials):
            started = time.perf_counter()
            await upload_checkpoint(store, saved)
            up.append(time.perf_counter() - started)
            started = time.perf_counter()
            await download_checkpoint(store, saved.name, work / f"cache-{i}")
            down.append(time.perf_counter() - started)
    return {"upload_s": round(statistics.median(up), 4), "fetch_s": round(statistics.median(down), 4)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    learner = _learner()
    with tempfile.TemporaryDirectory() as tmp, MotoServer() as moto:
        work = Path(tmp)
        saves = []
        for i in range(args.trials):
            started = time.perf_counter()
            saved = learner.save(work / f"local-{i}")
            saves.append(time.perf_counter() - started)
        num_bytes = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        return {
            "bench": "checkpoint_store", "num_bytes": num_bytes, "trials": args.trials,
            "local_save_s": round(statistics.median(saves), 4),
            "file": await _trials((work / "blobs").as_uri(), None, saved, work / "f", args.trials),
            "s3_moto": await _trials(f"s3://{bucket}/run", moto.endpoint, saved, work / "s", args.trials),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    print(json.dumps(asyncio.run(main_async(p.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
