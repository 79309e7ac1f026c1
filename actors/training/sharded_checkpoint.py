"""A trainer checkpoint written by N ranks and read back at any rank count.

Every file holds tensors under Hugging Face names (experts one per key, by their *global* index), so the
shards of one checkpoint, put together, are an HF checkpoint and the optimizer moments that go with it:

    step-V/rank-00000-of-00002.safetensors        this rank's weights (HF names)
    step-V/optimizer-rank-00000-of-00002.safetensors   their Adam moments (<HF name>.exp_avg / .exp_avg_sq)
    step-V/config.json, trainer_state.json        rank 0's, written last: the checkpoint exists from then on

Who writes what: the dense tensors are equal on every rank, so rank 0 writes them; each expert is written
by the one rank of the first expert group that holds it. No tensor is written twice. Reading takes the
union of every shard file, whatever the number of ranks that wrote them, and gives whole tensors under
this model's names; the learner then keeps the part its own rank holds (actors.training.ranks).

All ranks write into one temporary directory, meet at a barrier, and rank 0 renames it into place
(needs a directory every rank sees: the run directory locally, or shared storage).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from actors.training.ranks import RankLayout, is_expert_param
from model.checkpoint import from_hf_state_dict
from model.config import ModelConfig
from model.errors import CheckpointError

__all__ = ["is_sharded", "read_config", "read_shards", "shard_tensors", "write_shard"]

_STACKED_TO_PROJ = {"w_gate_EFD": "gate_proj", "w_up_EFD": "up_proj", "w_down_EDF": "down_proj"}
_WEIGHTS = re.compile(r"^rank-(\d{5})-of-(\d{5})\.safetensors$")


def _file(prefix: str, layout: RankLayout) -> str:
    return f"{prefix}rank-{layout.rank:05d}-of-{layout.world_size:05d}.safetensors"


def shard_tensors(named: dict[str, torch.Tensor], layout: RankLayout, first_expert: int,
                  tie_word_embeddings: bool, suffix: str = "") -> dict[str, torch.Tensor]:
    """What ``layout.rank`` writes of ``named`` (this model's names -> HF names + ``suffix``)."""
    out: dict[str, torch.Tensor] = {}
    writes_experts = layout.rank < layout.expert_parallel  # the first expert group
    for name, tensor in named.items():
        if is_expert_param(name):
            if not writes_experts:
                continue
            prefix, stacked = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                hf = f"{prefix}.experts.{first_expert + e}.{_STACKED_TO_PROJ[stacked]}.weight"
                out[hf + suffix] = tensor[e].detach().contiguous().cpu()
        elif layout.rank == 0 and not (name == "lm_head.weight" and tie_word_embeddings):
            out[name + suffix] = tensor.detach().contiguous().cpu()
    return out


def write_shard(directory: Path, layout: RankLayout, weights: dict[str, torch.Tensor],
                moments: dict[str, torch.Tensor]) -> None:
    """This rank's weight and moment files (HF names, from :func:`shard_tensors`) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / _file("", layout)), metadata={"format": "pt"})
    save_file(moments, str(directory / _file("optimizer-", layout)))


def is_sharded(directory: Path) -> bool:
    return any(_WEIGHTS.match(p.name) for p in directory.iterdir())


def read_shards(directory: Path, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Whole weights and moments (this model's names; moments as ``<name>.exp_avg``) from every shard.

    Raises:
        CheckpointError: shards of different world sizes, or one missing.
    """
    files = sorted(p for p in directory.iterdir() if _WEIGHTS.match(p.name))
    sizes = {int(_WEIGHTS.match(p.name).group(2)) for p in files}  # type: ignore[union-attr]
    if len(sizes) != 1 or len(files) != next(iter(sizes)):
        raise CheckpointError(f"{directory}: shard files {[p.name for p in files]} are not one complete set")
    weights_hf: dict[str, torch.Tensor] = {}
    moments_hf: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for path in files:
        weights_hf.update(load_file(str(path)))
        for key, tensor in load_file(str(directory / f"optimizer-{path.name}")).items():
            name, _, kind = key.rpartition(".")
            moments_hf[kind][name] = tensor
    moments: dict[str, torch.Tensor] = {}
    for kind, by_name in moments_hf.items():
        if by_name:
            for name, tensor in from_hf_state_dict(by_name, config).items():
                moments[f"{name}.{kind}"] = tensor
    return from_hf_state_dict(weights_hf, config), moments


def read_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
