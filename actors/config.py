"""The RL run's configuration: one typed section per part, shared by every actor kind of the run.

Keys made with ``live(...)`` can be changed while the run goes on (``python -m ops.config set``);
the rest are fixed at start. Defaults are the embedded default run (tiny policy, built-in tasks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from actors.agent import AgentConfig
from actors.lr_schedule import LRSchedule
from actors.scheduling import SchedulingConfig
from runtime.config import live
from sandbox.tasks import count_tasks

__all__ = [
    "EvalSection",
    "PolicySection",
    "RLConfig",
    "ReconcilerSection",
    "RewardSection",
    "RolloutSection",
    "TasksSection",
    "TrainerSection",
]


@dataclass(frozen=True)
class PolicySection:
    checkpoint: str = ""  # a local HF-layout directory; empty: the built-in starting policy
    cache_dir: Path = Path("runs/_cache")  # where the built-in starting policy is built once and kept
    experts_precision: str = "reference"  # reference | emulated | triton (kernels/)
    torch_threads: int = 1  # intra-op threads per actor process: 2 cores are shared by every actor

    def __post_init__(self) -> None:
        if self.experts_precision not in ("reference", "emulated", "triton"):
            raise ValueError(f"experts_precision={self.experts_precision!r}: use reference, emulated or triton")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads={self.torch_threads} must be >= 1")


@dataclass(frozen=True)
class TasksSection:
    seed: int = 0  # order of the training prompts
    num_train: int = 0  # 0: every generated training task
    num_heldout: int = 0  # 0: every generated held-out task
    # The shipped starting policy was supervised on difficulty-1 families only; harder families give it
    # no reward to learn from (every group all zero), so the default run trains where it can learn.
    difficulties: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for split, wanted in (("train", self.num_train), ("heldout", self.num_heldout)):
            available = count_tasks(split, self.difficulties)
            if not 0 <= wanted <= available:
                raise ValueError(f"tasks.num_{split}={wanted}, but the {split} split holds {available} tasks of "
                                 f"difficulties {list(self.difficulties)}; use at most {available} (0: all)")


@dataclass(frozen=True)
class RolloutSection:
    temperature: float = live(1.0)
    top_p: float = live(1.0)
    kv_policy: str = live("recompute")  # on an in-flight weight swap: keep | recompute
    max_batch_size: int = 64  # sequences the engine decodes together (a decode step of 64 costs ~1.6x one of 32)
    agent: AgentConfig = AgentConfig()
    warm_environments: int = 4

    def __post_init__(self) -> None:
        if self.kv_policy not in ("keep", "recompute"):
            raise ValueError(f"rollout.kv_policy={self.kv_policy!r}: use keep or recompute")
        if not 0.0 <= self.temperature <= 4.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.temperature={self.temperature} must be in [0, 4] and "
                             f"top_p={self.top_p} in (0, 1]")


@dataclass(frozen=True)
class RewardSection:
    """reward = pass fraction − length_coef · C(x) − malformed_call_penalty · #malformed calls.

    C(x) = ((1 + kx)^(1−q) − 1) / (k(1−q)) over x = the weighted count below (the seeds' nonlinear
    length penalty: steep for the first tokens, flattening for long hard work).
    """

    length_coef: float = live(0.0)  # 0: off (the built-in tasks need one short tool call)
    k: float = 0.01
    q: float = 0.5
    weight_thinking_tokens: float = 1.0
    weight_tool_call_tokens: float = 1.0
    weight_tool_output_tokens: float = 0.25
    weight_final_tokens: float = 1.0
    weight_tool_calls: float = 5.0
    weight_turns: float = 5.0
    malformed_call_penalty: float = live(0.1)

    def __post_init__(self) -> None:
        if self.k <= 0 or self.q == 1.0:
            raise ValueError(f"reward.k={self.k} must be > 0 and reward.q={self.q} must not be 1")


@dataclass(frozen=True)
class ReconcilerSection:
    # (eta + 1) * batch_size_groups * group_size: admission is then bound by staleness, not slots. With
    # 96 (1.5 batches) the 64 slots of a batch in training left room for 4 groups of rollouts, and the
    # default run took 10.7 s a version with its cores 45% idle; with 192, 7.8 s.
    num_slots: int = 192
    group_size: int = 8
    batch_size_groups: int = 8
    num_epochs: int = 2  # 1: single epoch, a prompt is never trained twice
    tick_s: float = 0.5  # timeouts and admission are re-checked at least this often
    status_every_s: float = 2.0
    # One rollout actor decodes up to 64 episodes together (rollout.max_batch_size, its max_concurrency):
    # a smaller in-flight cap leaves its engine batches part empty.
    scheduling: SchedulingConfig = field(default_factory=lambda: SchedulingConfig(max_inflight_per_rollout_actor=64))


@dataclass(frozen=True)
class TrainerSection:
    # The default run's schedule: cosine from 3e-4 to 3e-5 over its 70 steps gained 19.2/17.4/14.0 held-out
    # points (seeds 0/1/2) where constant 2e-4 gained 13.4/14.0/14.5; a 5e-4 peak destabilised the policy.
    lr: float = live(3e-4)  # the peak of the schedule; a live change rescales the whole schedule
    lr_schedule: str = "cosine"  # constant | cosine (from lr down to lr * lr_min_ratio over run.steps)
    lr_min_ratio: float = 0.1  # cosine only: the last step's lr is lr * lr_min_ratio
    betas: tuple[float, ...] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ratio_cap: float = 2.0
    kl_coef: float = live(0.0)
    router_replay: bool = True  # train with the experts the rollout used (R3)
    replay_plausibility_factor: float = 0.1  # replace replayed experts the router finds implausible
    loss_normalizer: float = 4096.0  # a constant: the loss is a token sum divided by this
    checkpoint_every: int = 1  # steps between checkpoints; a crash loses the steps since the last one
    keep_checkpoints: int = 2
    metrics_file: str = "metrics.jsonl"

    def __post_init__(self) -> None:
        if self.loss_normalizer <= 0 or self.checkpoint_every < 1:
            raise ValueError(f"trainer.loss_normalizer={self.loss_normalizer} must be > 0 and "
                             f"checkpoint_every={self.checkpoint_every} >= 1")
        try:  # the schedule checks its own parameters; num_steps is the run's, known only later
            LRSchedule(self.lr_schedule, self.lr, self.lr_min_ratio, num_steps=1)
        except ValueError as e:
            raise ValueError(f"{e} (trainer.lr_schedule={self.lr_schedule!r}, trainer.lr={self.lr}, "
                             f"trainer.lr_min_ratio={self.lr_min_ratio})") from None


@dataclass(frozen=True)
class EvalSection:
    every_versions: int = live(35)  # held-out evaluation after every this many policy versions
    # pass@1 at the rollout temperature (the policy RL trains), averaged over samples_per_task episodes
    # per task with seeds fixed per (task, sample): every version meets the same random numbers.
    # temperature = 0: greedy, the policy's most likely answer. Four episodes a task (344 on the
    # built-in held-out set): one pass@1 figure's standard error is ~2.6 points, not 3.8 as with two.
    temperature: float = 1.0
    samples_per_task: int = 4
    concurrency: int = 16

    def __post_init__(self) -> None:
        if self.samples_per_task < 1 or self.concurrency < 1:
            raise ValueError(f"eval.samples_per_task={self.samples_per_task} and eval.concurrency="
                             f"{self.concurrency} must be >= 1")
        if self.temperature == 0 and self.samples_per_task > 1:
            raise ValueError("eval.samples_per_task > 1 needs eval.temperature > 0 (greedy episodes are identical)")


@dataclass(frozen=True)
class RLConfig:
    policy: PolicySection = PolicySection()
    tasks: TasksSection = TasksSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    reconciler: ReconcilerSection = ReconcilerSection()
    trainer: TrainerSection = TrainerSection()
    eval: EvalSection = EvalSection()
