"""The starting policy of an RL run: the tiny model, supervised on perfect episodes of training tasks.

RL improves what the policy already does sometimes, so the recipe is calibrated to leave room: the data
are `reference_episode_text` of the difficulty-1 tasks of the train split of `sandbox.task_generator.generate_tasks`
(integer arithmetic; the held-out split is never trained on), and training stops shortly after the tiny
model starts copying the task's constant from the prompt into its answer. Measured on the way there: the
episode format is learned within ~60 steps, but the constant stays a fixed guess ("x-11", "x*66") until
copying emerges. That transition is sharp and depends on the data order: with seed 0's order (the whole
train split shuffled by the seed, then filtered to difficulty 1) it came between steps 300 and 400 at lr
6e-3 (held-out pass@1 at temperature 1: 5% at step 300, 39% at step 400); with the difficulty-1 tasks
shuffled on their own it had not come by step 400, 500 or 600 (pass@1 1-3%); at lr 3e-3, or on every
difficulty, not within 240-400 steps. So the default recipe pins seed 0 and that order, and another
`--seed` may need more steps. The default policy solves about half of the held-out difficulty-1 tasks at
temperature 1, with the digits still uncertain, and no task of difficulty 2-4: RL has easy tasks to
sharpen and hard ones to discover. The result is evaluated on the whole held-out split with the RL sampling settings
(temperature 1) and greedily, and saved as an HF-layout safetensors checkpoint with a JSON card.

    python -m actors.training.starting_policy [--out DIR] [--steps N] [--seed S]
    python -m actors.training.starting_policy --chains-from BASE_DIR [--out DIR] [--steps N] [--seed S]

The second form is the chain stage (`build_chain_policy`): a starting policy continued on reference chains of
the long-context family (actors.training.reference_chains: episodes that summarize when their window fills,
each segment one example, the policy's turns and summaries trained), mixed with the base recipe's own
examples so that what the base policy does is kept; the result is evaluated on held-out long-context tasks
with summarization on and off. RL on that family starts from it (``policy.checkpoint``). The default run's
recipe, its hash and its shipped checkpoint are unchanged by it.

`ensure_starting_policy(cache_dir)` is what a run calls: it returns a checkpoint built by the current
recipe (same recipe hash), from the cache, from the copy shipped in `actors/training/assets/`, or built now.
It blocks; from async code call it through `asyncio.to_thread`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from actors.agent.config import AgentConfig
from actors.agent.episode import reference_episode_text
from actors.training.evaluation import EvalResult, evaluate, greedy, sampled
from actors.training.reference_chains import LONG_CONTEXT_AGENT, chain_sft_examples, reference_chain
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import ModelConfig, tiny
from model.pretrain import PretrainConfig, Segment, pretrain
from model.tokenizer import ByteTokenizer
from model.transformer import MoETransformer
from runtime.build_once import build_locally
from sandbox.long_context_tasks import generate_long_context_tasks
from sandbox.task_generator import generate_tasks
from sandbox.tasks import Task

__all__ = [
    "CARD_NAME",
    "SHIPPED_DIR",
    "ChainStageRecipe",
    "StartingPolicyCard",
    "StartingPolicyRecipe",
    "build_chain_policy",
    "build_starting_policy",
    "default_recipe",
    "ensure_starting_policy",
    "sft_examples",
]

log = structlog.get_logger(__name__)

CARD_NAME = "card.json"
SHIPPED_DIR = Path(__file__).resolve().parent / "assets" / "starting_policy"
RECIPE_VERSION = 1  # bump when the meaning of a recipe changes without its fields changing
_ALL_TASKS = 10**6


@dataclasses.dataclass(frozen=True)
class StartingPolicyRecipe:
    """Everything that decides the starting checkpoint (its hash names the cache entry).

    Args:
        seed: seeds the weights, the data order and the sampled evaluation.
        difficulties: task difficulties trained on.
        num_train_tasks: train-split tasks used (None: every one of those difficulties).
        num_eval_tasks: held-out tasks evaluated (None: all of them).
        pretrain: the supervised optimisation (its seed is replaced by `seed`).
        model: the policy's shape.
        num_threads: torch CPU threads while building. One by default: the build then computes the same
            bits on any machine, and it does not collapse when other processes share the cores (with two
            threads on a busy 2-core machine one SFT step measured 26-42 s against 2.4 s with one).
        save_bf16: store the weights in bf16; the model is rounded to bf16 before it is evaluated,
            so the card's numbers are those of the stored weights.
        eval_greedy: also evaluate greedily (the card always has the temperature-1 result).
    """

    seed: int = 0
    difficulties: tuple[int, ...] = (1, 2, 3, 4)
    num_train_tasks: int | None = None
    num_eval_tasks: int | None = None
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    model: ModelConfig = dataclasses.field(default_factory=tiny)
    num_threads: int = 1
    save_bf16: bool = True
    eval_greedy: bool = True

    def __post_init__(self) -> None:
        if not self.difficulties:
            raise ValueError("StartingPolicyRecipe.difficulties is empty; name at least one difficulty")
        for name in ("num_train_tasks", "num_eval_tasks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"StartingPolicyRecipe.{name}={value} must be >= 1 or None (all tasks)")
        if self.num_threads < 1:
            raise ValueError(f"StartingPolicyRecipe.num_threads={self.num_threads} must be >= 1")

    def train_tasks(self) -> list[Task]:
        # the whole train split shuffled by the seed, then filtered: the data order the calibration measured
        pool = [t for t in _all_of_split("train", self.seed, None) if t.difficulty in self.difficulties]
        return pool if self.num_train_tasks is None else pool[: self.num_train_tasks]

    def eval_tasks(self) -> list[Task]:
        pool = _all_of_split("heldout", self.seed, None)
        return pool if self.num_eval_tasks is None else pool[: self.num_eval_tasks]

    def recipe_hash(self) -> str:
        """sha256 over the recipe, the recipe version and the exact training texts."""
        digest = hashlib.sha256()
        digest.update(json.dumps({"version": RECIPE_VERSION, **_jsonable(self)}, sort_keys=True).encode())
        for example in sft_examples(self.train_tasks()):
            digest.update(json.dumps(example).encode())
        return digest.hexdigest()


def _all_of_split(split: str, seed: int, difficulties: Sequence[int] | None) -> list[Task]:
    """Every task of a split, shuffled by `seed` (generate_tasks has no "all": find the pool size)."""
    lo, hi = 0, _ALL_TASKS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            generate_tasks(seed, mid, split, difficulties)
            lo = mid
        except ValueError:
            hi = mid - 1
    return generate_tasks(seed, lo, split, difficulties)


# ModelConfig fields added after recipes were first hashed, each with a default that computes what a model
# had before it existed: hashed only when set otherwise, so adding such a field keeps every recipe's hash
# (and the shipped starting policy) valid.
_MODEL_FIELDS_HASHED_WHEN_SET = ("architecture", "mlp_bias", "rope_scaling", "upcycling")


def _jsonable(recipe: StartingPolicyRecipe) -> dict[str, Any]:
    out = dataclasses.asdict(recipe)
    out["pretrain"] = dataclasses.asdict(_pretrain_config(recipe))
    defaults = ModelConfig()
    for name in _MODEL_FIELDS_HASHED_WHEN_SET:
        if getattr(recipe.model, name) == getattr(defaults, name):
            del out["model"][name]
    return out


def _pretrain_config(recipe: StartingPolicyRecipe) -> PretrainConfig:
    return dataclasses.replace(recipe.pretrain, seed=recipe.seed)


def default_recipe(seed: int = 0, num_steps: int | None = None) -> StartingPolicyRecipe:
    """The calibrated recipe the default run starts from (see the module docstring)."""
    config = PretrainConfig(num_steps=400, batch_size=8, lr=6e-3, min_lr=6e-4, warmup_steps=10, log_every=20)
    if num_steps is not None:
        config = dataclasses.replace(config, num_steps=num_steps, warmup_steps=min(config.warmup_steps, num_steps))
    return StartingPolicyRecipe(seed=seed, difficulties=(1,), pretrain=config)


def sft_examples(tasks: Sequence[Task]) -> list[list[Segment]]:
    """The supervised data: one perfect episode per task."""
    return [reference_episode_text(task) for task in tasks]


@dataclasses.dataclass(frozen=True)
class StartingPolicyCard:
    """What `card.json` records next to the checkpoint."""

    recipe_hash: str
    recipe: dict[str, Any]
    seed: int
    num_steps: int
    num_train_examples: int
    num_train_tokens: int
    final_loss: float
    heldout_sampled: dict[str, Any]
    heldout_greedy: dict[str, Any] | None
    train_s: float
    eval_s: float
    build_s: float
    created_unix: float
    torch_version: str

    @property
    def heldout_pass_at_1(self) -> float:
        return float(self.heldout_sampled["pass_at_1"])

    def write(self, directory: Path) -> None:
        (directory / CARD_NAME).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> StartingPolicyCard:
        return cls(**json.loads((directory / CARD_NAME).read_text()))


async def _evaluate_both(model: MoETransformer, recipe: StartingPolicyRecipe) -> tuple[EvalResult, EvalResult | None]:
    tasks = recipe.eval_tasks()
    agent = AgentConfig()
    at_t1 = await evaluate(model, tasks, sampling=sampled(1.0, 1.0, seed=recipe.seed), agent_config=agent)
    at_t0 = await evaluate(model, tasks, sampling=greedy(), agent_config=agent) if recipe.eval_greedy else None
    return at_t1, at_t0


def build_starting_policy(out_dir: str | os.PathLike[str], recipe: StartingPolicyRecipe) -> StartingPolicyCard:
    """Train, evaluate and save the starting policy into `out_dir` (created; existing files replaced)."""
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        torch.manual_seed(recipe.seed)
        model = MoETransformer(recipe.model).init_weights(recipe.seed)
        examples = sft_examples(recipe.train_tasks())
        result = pretrain(model, examples, ByteTokenizer(), _pretrain_config(recipe))
        if recipe.save_bf16:
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16).float())
        eval_started = time.monotonic()
        at_t1, at_t0 = asyncio.run(_evaluate_both(model, recipe))
        eval_s = time.monotonic() - eval_started
    finally:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    save_checkpoint(model, out, dtype=torch.bfloat16 if recipe.save_bf16 else None)
    card = StartingPolicyCard(
        recipe_hash=recipe.recipe_hash(),
        recipe=_jsonable(recipe),
        seed=recipe.seed,
        num_steps=result.num_steps,
        num_train_examples=result.num_examples,
        num_train_tokens=result.num_tokens,
        final_loss=round(result.losses[-1], 5),
        heldout_sampled=at_t1.summary(),
        heldout_greedy=None if at_t0 is None else at_t0.summary(),
        train_s=round(result.duration_s, 1),
        eval_s=round(eval_s, 1),
        build_s=round(time.monotonic() - started, 1),
        created_unix=round(time.time(), 1),
        torch_version=torch.__version__,
    )
    card.write(out)
    log.info(
        "starting_policy_built",
        directory=str(out),
        pass_at_1=card.heldout_pass_at_1,
        build_s=card.build_s,
        greedy_pass_at_1=None if at_t0 is None else at_t0.pass_at_1,
    )
    return card


def _matches(directory: Path, recipe_hash: str) -> bool:
    try:
        card = StartingPolicyCard.read(directory)
    except (OSError, ValueError, TypeError):
        return False
    return card.recipe_hash == recipe_hash and (directory / "model.safetensors").is_file()


def find_starting_policy(
    cache_dir: str | os.PathLike[str],
    recipe: StartingPolicyRecipe,
    *,
    shipped_dir: str | os.PathLike[str] | None = SHIPPED_DIR,
) -> tuple[Path | None, str]:
    """The checkpoint directory of `recipe` on this machine, without building it: in
    `cache_dir/<name>` or in `shipped_dir` (else None); and `<name>`, ``starting-policy-<hash>``.
    A run builds what is missing once for all its processes (`actors.agent.policy.run_checkpoint_dir`)."""
    recipe_hash = recipe.recipe_hash()
    name = f"starting-policy-{recipe_hash[:16]}"
    target = Path(cache_dir) / name
    if _matches(target, recipe_hash):
        return target, name
    if shipped_dir is not None and _matches(Path(shipped_dir), recipe_hash):
        log.info("starting_policy_shipped", directory=str(shipped_dir))
        return Path(shipped_dir), name
    return None, name


def ensure_starting_policy(
    cache_dir: str | os.PathLike[str],
    recipe: StartingPolicyRecipe | None = None,
    *,
    shipped_dir: str | os.PathLike[str] | None = SHIPPED_DIR,
) -> Path:
    """The checkpoint directory of `recipe` (default: `default_recipe()`), building it if needed, outside
    a run (the command line, tests; a run builds through its bus and store: `find_starting_policy`).

    Looks in `cache_dir/starting-policy-<hash>`, then in `shipped_dir`; on a miss builds into the cache
    (a temporary directory renamed into place, under a file lock, so concurrent callers build once).
    """
    recipe = recipe or default_recipe()
    found, name = find_starting_policy(cache_dir, recipe, shipped_dir=shipped_dir)
    if found is not None:
        return found
    return build_locally(Path(cache_dir), name, lambda out: build_starting_policy(out, recipe),
                         lambda path: _matches(path, recipe.recipe_hash()))


@dataclasses.dataclass(frozen=True)
class ChainStageRecipe:
    """The chain stage: a starting policy continued on reference chains of the long-context family.

    Args:
        seed: seeds the data order and the sampled evaluation.
        num_chain_tasks: long-context train tasks whose reference chains are trained on (each chain gives one
            example per segment).
        num_base_examples: examples of the base recipe mixed in (its train split, difficulty 1).
        num_eval_tasks: held-out long-context tasks evaluated, with summarization on and off.
        agent: the episode settings the reference chains are made with and evaluated under (summarization on;
            off is the same with ``summarize_at_tokens = 0``).
    """

    seed: int = 0
    num_chain_tasks: int = 300
    num_base_examples: int = 300
    num_eval_tasks: int = 32
    agent: AgentConfig = LONG_CONTEXT_AGENT
    pretrain: PretrainConfig = dataclasses.field(default_factory=lambda: PretrainConfig(
        num_steps=150, batch_size=8, lr=2e-3, min_lr=2e-4, warmup_steps=10, log_every=10))
    num_threads: int = 1

    def examples(self) -> list[list[Segment]]:
        chains = [ex for task in generate_long_context_tasks(self.seed, self.num_chain_tasks, "train")
                  for ex in chain_sft_examples(reference_chain(task, self.agent))]
        return chains + sft_examples(default_recipe(self.seed).train_tasks()[: self.num_base_examples])


def build_chain_policy(out_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str],
                       recipe: ChainStageRecipe | None = None) -> dict[str, Any]:
    """Continue the policy at ``base_dir`` on ``recipe``'s data, evaluate it on held-out long-context tasks
    with summarization on and off, save it (bf16) and its card into ``out_dir``; returns the card."""
    recipe = recipe or ChainStageRecipe()
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        _, model = load_checkpoint(base_dir)
        examples = recipe.examples()
        result = pretrain(model, examples, ByteTokenizer(), dataclasses.replace(recipe.pretrain, seed=recipe.seed))
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).float())
        tasks = generate_long_context_tasks(recipe.seed, recipe.num_eval_tasks, "heldout")
        off = dataclasses.replace(recipe.agent, summarize_at_tokens=0)
        evals = {name: asyncio.run(evaluate(model, tasks, sampling=sampled(1.0, 1.0, seed=recipe.seed),
                                            agent_config=agent)).summary()
                 for name, agent in (("summarize_on", recipe.agent), ("summarize_off", off))}
    finally:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    save_checkpoint(model, out, dtype=torch.bfloat16)
    card = {"base": str(base_dir), "recipe": dataclasses.asdict(recipe), "num_examples": result.num_examples,
            "num_train_tokens": result.num_tokens, "final_loss": round(result.losses[-1], 5),
            "heldout_long_context": evals, "build_s": round(time.monotonic() - started, 1),
            "torch_version": torch.__version__}
    (out / CARD_NAME).write_text(json.dumps(card, indent=2, sort_keys=True, default=str) + "\n")
    log.info("chain_policy_built", directory=str(out), **{f"pass_at_1_{k}": v["pass_at_1"] for k, v in evals.items()})
    return card


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the starting policy (SFT on train tasks, held-out eval).")
    parser.add_argument("--out", default="starting_policy", help="output directory (default: ./starting_policy)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chains-from", default=None, metavar="BASE_DIR",
                        help="the chain stage: continue the policy at BASE_DIR on long-context reference chains")
    args = parser.parse_args(argv)
    if args.chains_from:
        chain = ChainStageRecipe(seed=args.seed)
        if args.steps is not None:
            chain = dataclasses.replace(chain, pretrain=dataclasses.replace(chain.pretrain, num_steps=args.steps))
        card = build_chain_policy(args.out, args.chains_from, chain)
        print(json.dumps({k: v for k, v in card.items() if k != "recipe"}, indent=2))
        return
    recipe = default_recipe(seed=args.seed, num_steps=args.steps)
    card = build_starting_policy(args.out, recipe)
    print(json.dumps({k: v for k, v in dataclasses.asdict(card).items() if k != "recipe"}, indent=2))


if __name__ == "__main__":
    main()
