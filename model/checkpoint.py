"""Hugging Face-format checkpoints: safetensors (one file or an index of shards) plus config.json.

Stacked expert tensors map to per-expert HF keys:

    model.layers.{i}.mlp.w_gate_EFD[e]  <->  model.layers.{i}.mlp.experts.{e}.gate_proj.weight   (F, D)
    model.layers.{i}.mlp.w_up_EFD[e]    <->  model.layers.{i}.mlp.experts.{e}.up_proj.weight     (F, D)
    model.layers.{i}.mlp.w_down_EDF[e]  <->  model.layers.{i}.mlp.experts.{e}.down_proj.weight   (D, F)

Mixtral checkpoints use Mixtral's own names, which transformers 5.x still writes on disk (it fuses them
only in memory):

    model.layers.{i}.mlp.gate.weight    <->  model.layers.{i}.block_sparse_moe.gate.weight              (E, D)
    model.layers.{i}.mlp.w_gate_EFD[e]  <->  model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight   (F, D)
    model.layers.{i}.mlp.w_up_EFD[e]    <->  model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight   (F, D)
    model.layers.{i}.mlp.w_down_EDF[e]  <->  model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight   (D, F)

Loading also accepts the fused layout newer `transformers` versions use in memory
(`mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F)), and the Qwen3-MoE
per-expert names for any MoE architecture (the trainer's shards and weight updates use them).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from safetensors.torch import load_file, save_file

from model.config import Architecture, ModelConfig
from model.errors import CheckpointError
from model.experts import ExpertsFn, reference_experts_forward
from model.transformer import MoETransformer

__all__ = [
    "checked_state",
    "from_hf_state_dict",
    "load_checkpoint",
    "load_state_into",
    "save_checkpoint",
    "staged_directory",
    "to_hf_state_dict",
    "write_checkpoint",
]

log = structlog.get_logger(__name__)

_STACKED = {"w_gate_EFD": "gate_proj", "w_up_EFD": "up_proj", "w_down_EDF": "down_proj"}
_STACKED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp)\.(w_gate_EFD|w_up_EFD|w_down_EDF)$")
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MIXTRAL_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_GATE_KEY = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_OWN_GATE_KEY = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")


def _is_hf_expert_name(name: str) -> bool:
    return any(p.match(name) for p in (_EXPERT_KEY, _FUSED_KEY, _MIXTRAL_EXPERT_KEY, _MIXTRAL_GATE_KEY))


def _expert_slot(name: str, mixtral: bool) -> tuple[str, str, int] | None:
    """(`model.layers.{i}.mlp`, Qwen3-MoE projection name, expert) of a per-expert HF name, else None."""
    if m := _EXPERT_KEY.match(name):
        return m.group(1), m.group(3), int(m.group(2))
    if mixtral and (m := _MIXTRAL_EXPERT_KEY.match(name)):
        proj = next(k for k, v in _MIXTRAL_PROJ.items() if v == m.group(3))
        return f"{m.group(1)}.mlp", proj, int(m.group(2))
    return None


def to_hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    """Parameters under HF names (per-expert tensors are views; lm_head omitted when tied)."""
    mixtral = model.config.architecture is Architecture.MIXTRAL
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = _STACKED_KEY.match(name)
        if match:
            prefix, proj = match.group(1), _STACKED[match.group(2)]
            for e in range(tensor.shape[0]):
                if mixtral:
                    layer = prefix.removesuffix(".mlp")
                    out[f"{layer}.block_sparse_moe.experts.{e}.{_MIXTRAL_PROJ[proj]}.weight"] = tensor[e]
                else:
                    out[f"{prefix}.experts.{e}.{proj}.weight"] = tensor[e]
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        elif mixtral and (m := _OWN_GATE_KEY.match(name)):
            out[f"{m.group(1)}.block_sparse_moe.gate.weight"] = tensor
        else:
            out[name] = tensor
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Convert HF names (per-expert or fused experts; Mixtral's for a mixtral config) to this model's names.

    Mixtral names in a checkpoint of another architecture are left as they are, for `checked_state` to
    refuse as unexpected.

    Raises:
        CheckpointError: an expert is missing or given twice.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    f = config.moe_intermediate_size
    mixtral = config.architecture is Architecture.MIXTRAL
    for name, tensor in hf.items():
        if slot := _expert_slot(name, mixtral):
            prefix, proj, e = slot
            per_expert = experts.setdefault((prefix, proj), {})
            if e in per_expert:
                raise CheckpointError(f"{prefix}.experts.{e}.{proj}: given twice (the second as {name}); keep one "
                                      "naming of the experts")
            per_expert[e] = tensor
        elif mixtral and (m := _MIXTRAL_GATE_KEY.match(name)):
            out[f"{m.group(1)}.mlp.gate.weight"] = tensor
        elif m := _FUSED_KEY.match(name):
            if m.group(2) == "gate_up_proj":
                out[f"{m.group(1)}.w_gate_EFD"], out[f"{m.group(1)}.w_up_EFD"] = tensor[:, :f], tensor[:, f:]
            else:
                out[f"{m.group(1)}.w_down_EDF"] = tensor
        else:
            out[name] = tensor
    inverse = {v: k for k, v in _STACKED.items()}
    for (prefix, proj), per_expert in experts.items():
        if sorted(per_expert) != list(range(config.num_experts)):
            raise CheckpointError(
                f"{prefix}.experts.*.{proj}: expected experts 0..{config.num_experts - 1}, found {sorted(per_expert)}"
            )
        out[f"{prefix}.{inverse[proj]}"] = torch.stack([per_expert[e] for e in range(config.num_experts)])
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def checked_state(model: MoETransformer, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under this model's names (HF names converted) after checking keys and shapes.

    Raises:
        CheckpointError: a key is missing or unexpected, or a tensor's shape differs from the model's.
    """
    if any(_is_hf_expert_name(k) for k in state):
        state = from_hf_state_dict(state, model.config)
    own = model.state_dict()
    expected = {k for k in own if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    missing, unexpected = expected - state.keys(), state.keys() - own.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"state dict mismatch: missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    for name in expected:
        if own[name].shape != state[name].shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(state[name].shape)} != model shape {tuple(own[name].shape)}"
            )
    return {name: state[name] for name in expected}


def load_state_into(model: MoETransformer, state: dict[str, torch.Tensor]) -> None:
    """Copy a state dict (this model's names or HF names) into `model`, checking keys and shapes."""
    own = model.state_dict()
    with torch.no_grad():
        for name, value in checked_state(model, state).items():
            own[name].copy_(value)


def write_checkpoint(
    config: ModelConfig, tensors: dict[str, torch.Tensor], directory: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write HF-named `tensors` as `model.safetensors` and `config` as `config.json`; returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    out = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu() for k, v in tensors.items()}
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(dtype or next(iter(out.values())).dtype).removeprefix("torch.")
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    log.info("checkpoint_saved", directory=str(path), num_tensors=len(out))
    return path


@contextlib.contextmanager
def staged_directory(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir` to write a checkpoint into, renamed to `out_dir` when the block succeeds.

    The directory appears whole or not at all: a crash or an error never leaves a half-written checkpoint
    that a later run would use (the temporary directory is removed instead).

    Raises:
        CheckpointError: `out_dir` already exists.
    """
    out = Path(out_dir)
    if out.exists():
        raise CheckpointError(f"{out} already exists; remove it or pick another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is shared like any other
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename; a failure's leftovers otherwise


def save_checkpoint(model: MoETransformer, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `model.safetensors` and `config.json` (HF names) into `directory`; returns the directory."""
    return write_checkpoint(model.config, to_hf_state_dict(model), directory, dtype)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if not index.exists():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json exists")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(path / shard)))
    return tensors


def load_checkpoint(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    experts_fn: ExpertsFn = reference_experts_forward,
) -> tuple[ModelConfig, MoETransformer]:
    """Read config.json and safetensors from a local directory into a new model in `dtype`."""
    path = Path(directory)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}/config.json not found; is this a checkpoint directory?")
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    model = MoETransformer(config, experts_fn)
    load_state_into(model, _read_tensors(path))
    model = model.to(dtype)
    log.info("checkpoint_loaded", directory=str(path), num_parameters=config.num_parameters())
    return config, model
