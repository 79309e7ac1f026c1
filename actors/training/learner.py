"""The learner: the trainer's torch half. One RL step on a batch of group checkpoints, and its state.

Legend: T packed tokens, L layers, K experts per token.

The loss is model.loss.policy_loss (Dr. GRPO advantages, truncated importance ratio against the
behaviour log-probs, optional k1 KL against the starting policy, token sum over a constant). Router
replay feeds the rollout's recorded experts into the forward. Each step's learning rate comes from
actors.training.lr_schedule as a function of the version, set on the optimizer just before the step. The
state that makes a restart exact — weights, Adam moments, version, the batch ids already trained —
is saved together, atomically.

A sample is a chain of segments (actors.agent.episode: self-summarization): each segment is packed as its
own sequence (attention never crosses segments, as the policy never saw one from the other), and every
position of every segment carries the chain's one advantage, so the loss mask alone decides which tokens
train: every token the policy sampled, summaries included, and no template or tool-output token. The loss
normaliser keeps its meaning: the policy-gradient sum over every trained token of the batch, whichever
segment holds it, divided by the constant ``trainer.loss_normalizer`` (model.loss); a chain of K segments
weighs as the sum of its segments' tokens, exactly as if they had been one long sequence. A chain of one
segment packs and trains exactly as a trajectory did before chains.

Each token is scored at the temperature its behaviour log-prob was recorded at (the trajectory's
``logprob_temperatures``; model.sampling states the rule, top-p included), so on-policy the importance
ratio is exactly 1; every step reports the ratio's mean, median, min and max. Only trained tokens are scored:
what an untrained one records (a tool output's temperature) is never divided by, so it cannot reach the
gradient even past the input check. A step whose inputs, loss,
gradient or update holds a NaN or inf is not applied (actors.training.step_guard): the version still advances,
as for a batch without signal, the weights stay those of the last good step, and the step's metrics and
a ``step_skipped_non_finite`` event name the offending samples.

With ``trainer.micro_batch_tokens`` the computed samples (a rank's share) go through forward and backward in
consecutive micro-batches of at most that many tokens, a sample (every segment of its chain) never split, and
the gradients accumulate into one optimizer step: the loss is a token sum over a constant, so the micro-batches'
losses add up to the batch's, and their metrics combine as the ranks' do (model.loss.combine_metrics). Only one
micro-batch's activations (its T x V logits above all) are held at a time. Every rank runs the same number of
micro-batches, the largest any rank needs (a rank with fewer runs masked ones, contributing exactly 0), and
the loss of each is checked on every rank before its backward. With ``trainer.activation_checkpointing`` each
layer keeps only its input until the backward, which recomputes the rest (model.activation_checkpoint: the
forward's routing and counters, one more forward of compute).

For people, each step keeps what its forward scored every trained token of its samples at
(`Learner.trained_logprobs`: the detached log-probs the loss took, copied off the device once per step, float32
as computed; no extra forward): the trainer stage stores them for the rollout viewer, beside the behaviour
log-probs the sampler recorded.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file, save_file

from actors.config import TrainerSection
from actors.records import GroupRecord, GroupSample, TrainerLogprobs
from actors.training.lr_schedule import LRSchedule
from actors.training.ranks import RankGroup, is_expert_param
from actors.training.sharded_checkpoint import is_sharded, read_config, read_shards, shard_tensors, write_shard
from actors.training.step_guard import (
    NonFiniteStage,
    NonFiniteStep,
    NonFiniteWeights,
    Rollback,
    check_trajectories,
    non_finite_inputs,
    non_finite_parameters,
    sample_ids,
    samples_at_positions,
)
from model.checkpoint import load_checkpoint, load_state_into, save_checkpoint
from model.loss import (
    PolicyLossConfig,
    PolicyLossMetrics,
    combine_metrics,
    packed_logprobs,
    policy_loss,
    token_entropy,
)
from model.packing import PackedBatch, SequenceCost, pack_sequences
from model.router import RouterReplayConfig, RoutingStats
from model.transformer import MoETransformer

log = structlog.get_logger(__name__)

__all__ = ["Learner", "StepMetrics", "checkpoint_name", "checkpoint_version"]

STATE_FILE = "trainer_state.json"
_NO_TOKENS = PolicyLossMetrics(num_tokens=0, pg_loss=0.0, kl=0.0, clip_fraction=0.0, ratio_mean=1.0, ratio_min=1.0,
                               ratio_max=1.0, ratio_median=1.0, entropy=float("nan"))


def checkpoint_name(version: int) -> str:
    """The directory ``Learner.save`` writes the checkpoint of ``version`` to: names sort as versions do."""
    return f"step-{version:07d}"


def checkpoint_version(name: str) -> int:
    """The version of the checkpoint that ``Learner.save`` named ``name``."""
    return int(name.removeprefix("step-"))


@dataclass(frozen=True)
class StepMetrics:
    version: int
    num_groups: int
    num_samples: int
    num_computed: int  # samples in the forward: those with a non-zero advantage (all of them with a KL term)
    num_tokens: int
    num_trained_tokens: int
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    clip_fraction: float
    ratio_mean: float  # importance ratio over the trained tokens: exactly 1 on-policy at any temperature
    ratio_median: float
    ratio_min: float
    ratio_max: float
    grad_norm: float
    lr: float  # the learning rate of this step (the schedule's value at the version it started from)
    reward_mean: float
    pass_rate: float
    lag_min: int
    lag_max: int
    lag_histogram: dict[str, int]
    num_versions_in_batch: int
    replay_replaced_fraction: float
    step_s: float
    tokens_per_s: float
    skipped: str = ""  # the NonFiniteStage that refused the step ("" when it was applied)
    non_finite_sample_ids: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Learner:
    """The policy being trained, its optimizer and version.

    Args:
        model: the policy (put in train mode).
        config: the trainer section; ``lr``, ``lr_schedule`` and ``lr_min_ratio`` make the schedule.
        version: the policy version of ``model`` (a resumed checkpoint's).
        num_steps: the run's step budget (``run.steps``; 0: unbounded), the length of a cosine schedule.
        ranks: this process's place in the trainer's process group (actors.training.ranks); every rank
            builds its learner from the same full model and is given the same batches: each computes its
            share and the step is the one a single rank would take. Default: one rank.
    """

    def __init__(self, model: MoETransformer, config: TrainerSection, version: int = 0, num_steps: int = 0,
                 ranks: RankGroup | None = None) -> None:
        self.ranks = ranks or RankGroup.single()
        model = self.ranks.prepare(model)  # its expert shard only, when experts are spread over ranks
        self.cost = SequenceCost.for_model(model.config)
        self.model = model.train()
        self.device = next(model.parameters()).device  # policy.device: the caller placed the model
        self.config = config
        self.version = version
        self.schedule = LRSchedule.for_run(config.lr_schedule, config.lr, config.lr_min_ratio, num_steps)
        self.trained_batches: list[str] = []
        self.trained_groups: dict[str, int] = {}  # group id -> the version its step made: trained once
        # the last step's forward, per sample of this rank's share: its trained tokens' log-probs (for people)
        self.trained_logprobs: list[TrainerLogprobs] = []
        self.router_replay = (RouterReplayConfig(config.replay_plausibility_factor) if config.router_replay
                              else None)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.schedule.lr_at(version),
                                           betas=tuple(config.betas), weight_decay=config.weight_decay)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if config.kl_coef > 0 else None
        model.set_activation_checkpointing(config.activation_checkpointing)  # the reference runs without grad

    def set_lr(self, lr: float) -> None:
        """A new peak learning rate (a live ``trainer.lr``): the schedule keeps its shape, scaled to it."""
        self.schedule = self.schedule.with_peak(lr)
        self._apply_lr()

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.schedule.lr_at(self.version)

    def _apply_lr(self) -> float:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self, groups: Sequence[GroupRecord], batch_id: str) -> StepMetrics:
        """One optimizer step over every sample of ``groups`` (the batch ``batch_id``); the version then goes
        up by one."""
        started = time.perf_counter()
        samples = [s for g in groups for s in g.samples]
        if not samples:
            raise ValueError(f"batch {batch_id} has no samples")
        check_trajectories(samples)
        self.trained_logprobs = []
        # Without a KL term a sample whose advantage is exactly 0 (its group's rewards all equal) adds
        # nothing to the gradient: leaving it out of the forward gives the same update for less compute.
        computed = samples if self.config.kl_coef > 0 else [s for s in samples if s.advantage != 0.0]
        lr = self._apply_lr()
        # every sample, computed or not: a reward of -inf has an advantage of 0 in a record written before the
        # grouping refused it (every rank sees every sample: the same verdict everywhere)
        refused = non_finite_inputs(samples)
        if refused is not None:
            loss, m, grad_norm, replaced, num_tokens = torch.tensor(float("nan")), _NO_TOKENS, float("nan"), 0.0, 0
        elif computed:
            loss, m, grad_norm, replaced, num_tokens, refused = self._optimize(computed)
        else:
            loss, m, grad_norm, replaced, num_tokens = torch.zeros(()), _NO_TOKENS, 0.0, 0.0, 0
            log.info("batch_without_signal", batch_id=batch_id, num_samples=len(samples))
        if refused is not None:
            log.error("step_skipped_non_finite", batch_id=batch_id, version=self.version, stage=refused.stage.value,
                      sample_ids=list(refused.sample_ids), detail=refused.detail, loss=float(loss.detach()),
                      grad_norm=grad_norm)
        self.version += 1
        self.trained_batches.append(batch_id)
        self.trained_groups.update((g.group_id, self.version) for g in groups)
        elapsed = time.perf_counter() - started
        lags = [self.version - 1 - v for s in samples for seg in s.trajectory.segments
                for v, keep in zip(seg.versions, seg.loss_mask, strict=True) if keep]
        histogram: dict[str, int] = {}
        for lag in lags:
            histogram[str(lag)] = histogram.get(str(lag), 0) + 1
        rewards = [s.reward for s in samples]
        return StepMetrics(
            version=self.version, num_groups=len(groups), num_samples=len(samples), num_computed=len(computed),
            num_tokens=num_tokens,
            num_trained_tokens=m.num_tokens, loss=float(loss.detach()), pg_loss=m.pg_loss, kl=m.kl,
            entropy=m.entropy, clip_fraction=m.clip_fraction, ratio_mean=m.ratio_mean, ratio_median=m.ratio_median,
            ratio_min=m.ratio_min, ratio_max=m.ratio_max,
            grad_norm=grad_norm, lr=lr, reward_mean=sum(rewards) / len(rewards),
            pass_rate=sum(s.components.pass_fraction == 1.0 for s in samples) / len(samples),
            lag_min=min(lags, default=0), lag_max=max(lags, default=0), lag_histogram=histogram,
            num_versions_in_batch=len({v for s in samples for seg in s.trajectory.segments for v in seg.versions
                                       if v >= 0}),
            replay_replaced_fraction=replaced, step_s=elapsed,
            tokens_per_s=num_tokens / elapsed if elapsed > 0 else 0.0,
            skipped=refused.stage.value if refused else "",
            non_finite_sample_ids=refused.sample_ids if refused else ())

    def _forward_loss(
        self, samples: Sequence[GroupSample], *, masked: bool = False
    ) -> tuple[torch.Tensor, PolicyLossMetrics, torch.Tensor, PackedBatch, RoutingStats, torch.Tensor, torch.Tensor]:
        """The loss of ``samples``, its metrics, the per-position log-probs (the reference's added: any non-finite
        one shows), the batch, the replay counters, the importance ratios of the trained tokens and the policy's
        per-position log-probs as the loss took them (detached). ``masked``: every token out of the loss (a rank
        without a sequence of its own joins the collectives with one, contributing exactly 0)."""
        # a chain's segments are separate sequences of one sample (its advantage reaches each of them)
        batch = pack_sequences([seg.token_ids for s in samples for seg in s.trajectory.segments]).to(self.device)
        behaviour, temperatures, mask, advantages, replay = (
            t.to(self.device) for t in _aligned(samples, batch.num_tokens))
        if masked:
            mask = torch.zeros_like(mask)
        loss_cfg = PolicyLossConfig(self.config.ratio_cap, self.config.kl_coef, self.config.loss_normalizer)
        # only the trained positions are scored: what the others record (a tool output's temperature) is never
        # divided by, so it cannot reach the gradient (model.loss._temperatures says why a mask after is too late)
        logp, out = packed_logprobs(self.model, batch, replay if self.router_replay else None, self.router_replay,
                                    temperatures, mask)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = packed_logprobs(self.reference, batch, replay, self.router_replay, temperatures, mask)
        entropy = token_entropy(out.logits.detach(), temperatures, mask)
        loss, m = policy_loss(logp, behaviour, advantages, mask, loss_cfg, ref, entropy)
        ratios = torch.exp((logp.detach() - behaviour)[mask])
        stats = RoutingStats() if masked else out.routing_stats
        return loss, m, logp.detach() + (0.0 if ref is None else ref), batch, stats, ratios, logp.detach()

    def _optimize(
        self, samples: Sequence[GroupSample]
    ) -> tuple[torch.Tensor, PolicyLossMetrics, float, float, int, NonFiniteStep | None]:
        """Forward, loss, backward and one Adam step over ``samples``: loss, metrics, grad norm, replay
        fraction, the number of tokens packed, and why the step was refused (None when applied)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ranks = self.ranks
        # a chain goes whole to one rank, balanced by its tokens over every segment (its cost as one sequence
        # of that length: an over-estimate for a chain of several, whose attention is per segment)
        share = [samples[i] for i in ranks.my_share([s.trajectory.num_tokens for s in samples], self.cost)]
        parts = _micro_batches([s.trajectory.num_tokens for s in share], self.config.micro_batch_tokens)
        # every rank runs as many forwards and backwards (expert parallelism's all-to-alls pair up across ranks
        # in each): one with fewer micro-batches, or none, runs masked ones, each contributing exactly 0
        count = 1
        if self.config.micro_batch_tokens:  # the same key on every rank: all of them meet this gather
            count = max(1, *(int(n) for n in ranks.gather(len(parts))))  # type: ignore[call-overload]
        metrics: list[tuple[PolicyLossMetrics, torch.Tensor]] = []
        stats, losses, share_tokens, failed = RoutingStats(), [], 0, False
        for i in range(count):
            mine = [share[j] for j in parts[i]] if i < len(parts) else []
            loss, m, scored, batch, part_stats, ratios, policy_logp = self._forward_loss(mine or samples[:1],
                                                                                        masked=not mine)
            if mine:
                self.trained_logprobs.extend(_trainer_logprobs(mine, policy_logp, self.version))
                share_tokens += batch.num_tokens
            metrics.append((m, ratios))
            stats = stats + part_stats
            losses.append(float(loss.detach()))
            # every rank decides together, on each micro-batch, before any backward of it
            if ranks.any(not bool(torch.isfinite(loss))):
                failed = True
                break
            loss.backward()
        num_tokens = int(ranks.sum(share_tokens))
        m = ranks.combine_loss_metrics(metrics[0][0] if len(metrics) == 1 else combine_metrics(metrics),
                                       torch.cat([r for _, r in metrics]))
        replaced = ranks.combine_routing(stats).replaced_fraction
        total_loss = torch.tensor(ranks.sum(losses[0] if len(losses) == 1 else math.fsum(losses)))
        # From here every branch is taken by every rank together: each is decided by an all-reduce (or on a
        # value all-reduced), and each rank then meets the same collectives, whatever its share.
        if failed:
            # the micro-batch that failed names its samples; a rank whose micro-batch was masked names nothing
            culprits = samples_at_positions(~torch.isfinite(scored) & batch.target_mask_T, batch.seq_lens,
                                            [s for s in mine for _ in s.trajectory.segments]) if mine else ()
            named = tuple(n for part in ranks.gather(culprits) for n in part)  # type: ignore[attr-defined]
            self.optimizer.zero_grad(set_to_none=True)  # earlier micro-batches' gradients: never applied
            refused = NonFiniteStep(NonFiniteStage.LOSS, named or sample_ids(samples), f"loss={float(total_loss)}")
            return total_loss, m, float("nan"), replaced, num_tokens, refused
        ranks.reduce_gradients(self.model)
        grad_norm = ranks.clip_gradients(self.model, self.config.grad_clip)  # the group's norm, on every rank
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            # naming the samples takes a backward per sample: collectives could not pair up across ranks
            culprits = sample_ids(samples) if ranks.distributed else self._samples_with_non_finite_gradient(samples)
            refused = NonFiniteStep(NonFiniteStage.GRADIENT, culprits, f"grad_norm={grad_norm}")
            return total_loss, m, grad_norm, replaced, num_tokens, refused
        rollback = Rollback(self.model, self.optimizer)
        self.optimizer.step()
        bad = non_finite_parameters(self.model, self.optimizer)
        refused = None
        if ranks.any(bool(bad)):
            rollback.restore()
            refused = NonFiniteStep(NonFiniteStage.UPDATE, sample_ids(samples),
                                    f"non-finite after the update: {bad[:8] or 'on another rank'}")
        return total_loss, m, grad_norm, replaced, num_tokens, refused

    def _samples_with_non_finite_gradient(self, samples: Sequence[GroupSample]) -> tuple[str, ...]:
        """Each sample's own backward, to name those whose gradient is not finite (only on a failed step)."""
        culprits = []
        for i, s in enumerate(samples):
            self.optimizer.zero_grad(set_to_none=True)
            loss, *_ = self._forward_loss([s])
            loss.backward()
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                culprits.append(sample_ids(samples)[i])
        self.optimizer.zero_grad(set_to_none=True)
        return tuple(culprits) or sample_ids(samples)

    # --- state ----------------------------------------------------------------------------------
    def save(self, directory: Path) -> Path:
        """Writes weights (HF safetensors), optimizer moments and trainer state; visible atomically.

        With several ranks every rank calls it: each writes its shard (actors.training.sharded_checkpoint)
        and rank 0 makes the checkpoint visible once all are written."""
        bad = non_finite_parameters(self.model, self.optimizer)
        if self.ranks.any(bool(bad)):  # unreachable through step(); a checkpoint must never carry them
            raise NonFiniteWeights(f"refusing to save version {self.version}: non-finite values in "
                                   f"{bad[:8] or 'another rank'}")
        final = directory / checkpoint_name(self.version)
        if self.ranks.distributed:
            return self._save_sharded(directory, final)
        tmp = directory / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(self.model, tmp)
        save_file(_optimizer_tensors(self.optimizer, self.model), str(tmp / "optimizer.safetensors"))
        (tmp / STATE_FILE).write_text(json.dumps(self._state()))
        self._publish_checkpoint(tmp, final, directory)
        return final

    def _state(self) -> dict[str, Any]:
        return {"version": self.version, "trained_batches": self.trained_batches, "trained_groups": self.trained_groups,
                "optimizer_steps": _optimizer_steps(self.optimizer), "lr": self.optimizer.param_groups[0]["lr"],
                "world_size": self.ranks.layout.world_size, "expert_parallel": self.ranks.layout.expert_parallel}

    def _publish_checkpoint(self, tmp: Path, final: Path, directory: Path) -> None:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(directory.glob("step-*"))[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def _save_sharded(self, directory: Path, final: Path) -> Path:
        layout, model = self.ranks.layout, self.model
        tmp = directory / f".tmp-{final.name}-ranks"
        if layout.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a group killed while writing left it
            tmp.mkdir(parents=True)
        self.ranks.barrier()
        shard = getattr(model, "expert_shard", None)
        first = shard.first if shard is not None else 0
        tie = model.config.tie_word_embeddings
        names = {id(p): n for n, p in model.named_parameters()}
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            per_param = {names[id(p)]: st[key] for p, st in self.optimizer.state.items() if key in st}
            moments.update(shard_tensors(per_param, layout, first, tie, suffix=f".{key}"))
        write_shard(tmp, layout, shard_tensors(dict(model.named_parameters()), layout, first, tie), moments)
        self.ranks.barrier()  # every shard is on disk
        if layout.rank == 0:
            hf_config = model.config.to_hf_dict()
            hf_config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
            (tmp / STATE_FILE).write_text(json.dumps(self._state()))
            self._publish_checkpoint(tmp, final, directory)
        self.ranks.barrier()  # visible to every rank before any returns
        return final

    @classmethod
    def latest_checkpoint(cls, directory: Path) -> Path | None:
        done = sorted(p for p in directory.glob("step-*") if (p / STATE_FILE).exists())
        return done[-1] if done else None

    @classmethod
    def load(cls, path: Path, config: TrainerSection, num_steps: int = 0,
             device: torch.device | str = "cpu", ranks: RankGroup | None = None) -> Learner:
        """The learner saved at ``path``, on ``device``, as rank ``ranks`` (any rank count: the one that saved
        it or another); its schedule continues from the saved version."""
        if is_sharded(path):
            model_config = read_config(path)
            weights, moments = read_shards(path, model_config)
            model = MoETransformer(model_config)
            load_state_into(model, weights)
        else:
            _, model = load_checkpoint(path)
            moments = load_file(str(path / "optimizer.safetensors"))
        model = model.to(device)
        state = json.loads((path / STATE_FILE).read_text())
        learner = cls(model, config, int(state["version"]), num_steps, ranks)
        learner.trained_batches = list(state["trained_batches"])
        learner.trained_groups = {str(g): int(v) for g, v in state.get("trained_groups", {}).items()}
        _load_optimizer(learner.optimizer, learner.model, _local_moments(moments, learner.model),
                        int(state["optimizer_steps"]))
        log.info("learner_resumed", path=str(path), version=learner.version,
                 num_trained_batches=len(learner.trained_batches))
        return learner


def _micro_batches(lengths: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of the samples of ``lengths`` (tokens, every segment of a chain counted), each of at
    most ``budget`` tokens, save a sample longer than it, alone (0: every sample in one run; none: no runs)."""
    if not lengths:
        return []
    if budget <= 0:
        return [range(len(lengths))]
    parts, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > budget:
            parts.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    parts.append(range(start, len(lengths)))
    return parts


def _aligned(samples: Sequence[GroupSample], num_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed position p: behaviour log-prob, its temperature, loss mask and advantage of token p+1;
    router rows of p. Sequences are the samples' segments in order; each takes its chain's advantage."""
    behaviour = torch.zeros(num_tokens)
    temperatures = torch.ones(num_tokens)
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    advantages = torch.zeros(num_tokens)
    replay_rows = []
    offset = 0
    for sample, t in ((s, seg) for s in samples for seg in s.trajectory.segments):
        n = len(t.token_ids)
        behaviour[offset:offset + n - 1] = torch.tensor(t.behaviour_logprobs[1:])
        # float32 from the same Python floats as the sampler's temperatures: the same division, bit for bit
        temperatures[offset:offset + n - 1] = torch.tensor(t.logprob_temperatures[1:], dtype=torch.float32)
        mask[offset:offset + n - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        advantages[offset:offset + n] = sample.advantage
        assert t.topk_ids_TLK is not None  # check_trajectories refused a sample without its router choices
        replay_rows.append(torch.from_numpy(t.topk_ids_TLK[:n]).long())  # a view of the record's int16, widened
        offset += n
    return behaviour, temperatures, mask, advantages, torch.cat(replay_rows, dim=0)


def _trainer_logprobs(samples: Sequence[GroupSample], logp_T: torch.Tensor, version: int) -> list[TrainerLogprobs]:
    """Each sample's `TrainerLogprobs` from the packed per-position log-probs of its forward (position p scores
    token p+1 of its sequence; a sample's segments are consecutive sequences, as `_aligned` lays them out)."""
    values = logp_T.float().cpu()  # one copy off the device for the whole step
    out, offset = [], 0
    for sample in samples:
        segments = []
        for seg in sample.trajectory.segments:
            n = len(seg.token_ids)
            row = torch.full((n,), float("nan"))
            trained = torch.tensor(seg.loss_mask[1:], dtype=torch.bool)
            row[1:][trained] = values[offset:offset + n - 1][trained]
            segments.append(row.numpy().astype("<f4").tobytes())
            offset += n
        out.append(TrainerLogprobs(sample.sample_id, version, tuple(segments)))
    return out


def _local_moments(moments: dict[str, torch.Tensor], model: MoETransformer) -> dict[str, torch.Tensor]:
    """Whole-model moments cut to the experts ``model`` holds (all of them without expert parallelism)."""
    shard = getattr(model, "expert_shard", None)
    if shard is None:
        return moments
    return {k: v[shard.first:shard.first + shard.num_local] if is_expert_param(k.rsplit(".", 1)[0]) else v
            for k, v in moments.items()}


def _optimizer_tensors(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{names[id(p)]}.{key}"] = state[key].contiguous().cpu()
    return out


def _optimizer_steps(opt: torch.optim.Optimizer) -> int:
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps, default=0)


def _load_optimizer(opt: torch.optim.Optimizer, model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                    steps: int) -> None:
    for name, p in model.named_parameters():
        if f"{name}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(float(steps)), "exp_avg": tensors[f"{name}.exp_avg"].to(p.device),
                            "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(p.device)}
