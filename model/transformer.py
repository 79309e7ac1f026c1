"""The decoder (Qwen3-MoE, or dense Qwen3 / Llama by config) over packed variable-length sequences.

Legend: T packed tokens, D hidden size, V vocabulary, L layers, K experts per token, N logit rows.

Parameter names follow Hugging Face (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
`model.layers.{i}.mlp.gate.weight`, `model.norm.weight`, `lm_head.weight`) except the stacked expert
tensors (`model.layers.{i}.mlp.w_gate_EFD`, ...), which `model.checkpoint` maps to per-expert HF keys.

Dense architectures use `model.mlp.DenseMLP` (`mlp.gate_proj`, `mlp.up_proj`, `mlp.down_proj`) where the
MoE block sits; they route nothing, so their expert ids are (T, L, 0) and their routing counters zero.

One forward serves training (packed, no cache; see `AttentionBatch.packed`) and generation (KV cache,
`AttentionBatch.cached`). It returns logits, the experts every token used in every layer (router capture)
and router-replay counters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from model.activation_checkpoint import checkpointed_layer
from model.attention import Attention, AttentionBatch
from model.config import ModelConfig
from model.experts import ExpertsFn, reference_experts_forward
from model.layers import RMSNorm, RotaryEmbedding
from model.mlp import DenseMLP
from model.moe import MoEBlock
from model.router import RouterReplayConfig, Routing, RoutingStats

__all__ = ["DecoderLayer", "MoETransformer", "ModelOutput"]


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """Logits (N, V), expert ids (T, L, K) of every token and layer, and summed replay counters."""

    logits: torch.Tensor
    topk_ids_TLK: torch.Tensor
    routing_stats: RoutingStats
    layer_stats: tuple[RoutingStats, ...]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)), the MLP a MoE block or dense by config."""

    def __init__(self, config: ModelConfig, layer_idx: int, experts_fn: ExpertsFn) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MoEBlock | DenseMLP = MoEBlock(config, experts_fn) if config.is_moe else DenseMLP(config)

    def forward(
        self,
        h_TD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        replay_topk_ids_TK: torch.Tensor | None = None,
        replay: RouterReplayConfig | None = None,
        pinned: list[Routing] | None = None,
    ) -> tuple[torch.Tensor, Routing | None]:
        """The layer's output and its routing (None when dense); ``pinned``: see `MoEBlock.forward`."""
        h_TD = h_TD + self.self_attn(self.input_layernorm(h_TD), cos, sin, batch)
        x_TD = self.post_attention_layernorm(h_TD)
        if isinstance(self.mlp, MoEBlock):
            y_TD, routing = self.mlp(x_TD, replay_topk_ids_TK, replay, pinned)
            return h_TD + y_TD, routing
        return h_TD + self.mlp(x_TD), None


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, experts_fn: ExpertsFn) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, experts_fn) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


def _as_batch(num_tokens: int, seq_lens: Sequence[int] | torch.Tensor | None, device: torch.device) -> AttentionBatch:
    if seq_lens is None:
        return AttentionBatch.packed([num_tokens], device)
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if sum(lens) != num_tokens or min(lens, default=1) <= 0:
        raise ValueError(f"seq_lens {lens} must be positive and sum to the number of tokens {num_tokens}")
    return AttentionBatch.packed(lens, device)


class MoETransformer(nn.Module):
    """Qwen3-MoE causal LM (every layer sparse), or dense Qwen3 / Llama. Experts run through a settable `ExpertsFn`."""

    def __init__(self, config: ModelConfig, experts_fn: ExpertsFn = reference_experts_forward) -> None:
        super().__init__()
        self.config = config
        self._experts_fn = experts_fn
        self.activation_checkpointing = False  # set_activation_checkpointing
        self.model = _Backbone(config, experts_fn)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def experts_fn(self) -> ExpertsFn:
        return self._experts_fn

    def set_experts_fn(self, fn: ExpertsFn) -> None:
        """Use `fn` for the experts of every MoE layer (reference, emulated low precision, Triton).

        A dense model keeps `fn` for the record only: it has no experts to run it on.
        """
        self._experts_fn = fn
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.experts_fn = fn

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each layer's activations in the backward instead of keeping them (model.activation_checkpoint):
        applies to forwards that record a graph; one without grad keeps nothing either way."""
        self.activation_checkpointing = enabled

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> MoETransformer:
        """Deterministic init: N(0, initializer_range) for matrices, ones for norms, zeros for biases."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        return self

    def forward(
        self,
        input_ids_T: torch.Tensor,
        *,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        batch: AttentionBatch | None = None,
        replay_topk_ids_TLK: torch.Tensor | None = None,
        replay: RouterReplayConfig | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Run packed sequences.

        Args:
            input_ids_T: token ids of all sequences back to back, shape (T,).
            seq_lens: lengths of the packed sequences (training layout); default one sequence.
            cu_seqlens: the same as start offsets plus the total, shape (num_sequences + 1,).
            batch: an explicit layout instead of `seq_lens` (the engine passes a cached one).
            replay_topk_ids_TLK: recorded expert ids per token and layer to route with (-1 rows = none).
            replay: router replay settings (plausibility factor).
            logits_rows: token rows whose logits to compute (default all); saves the LM head elsewhere.
        """
        if input_ids_T.dim() != 1:
            raise ValueError(f"input_ids_T must be 1-D (packed), got shape {tuple(input_ids_T.shape)}")
        if cu_seqlens is not None:
            if seq_lens is not None:
                raise ValueError("pass seq_lens or cu_seqlens, not both")
            seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if batch is None:
            batch = _as_batch(input_ids_T.shape[0], seq_lens, input_ids_T.device)
        h_TD = self.model.embed_tokens(input_ids_T)
        cos, sin = self.model.rotary(batch.position_ids_T, h_TD.dtype)
        ids_per_layer, stats = [], []
        no_experts_TK = torch.empty(input_ids_T.shape[0], 0, dtype=torch.long, device=input_ids_T.device)
        checkpointed = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            replay_TK = None if replay_topk_ids_TLK is None else replay_topk_ids_TLK[:, i]
            if checkpointed:
                h_TD, routing = checkpointed_layer(layer, h_TD, cos, sin, batch, replay_TK, replay)
            else:
                h_TD, routing = layer(h_TD, cos, sin, batch, replay_TK, replay)
            ids_per_layer.append(no_experts_TK if routing is None else routing.topk_ids_TK)
            stats.append(RoutingStats() if routing is None else routing.stats)
        if logits_rows is not None:
            h_TD = h_TD.index_select(0, logits_rows)
        logits = self.lm_head(self.model.norm(h_TD))
        total = sum(stats[1:], stats[0]) if stats else RoutingStats()
        return ModelOutput(logits, torch.stack(ids_per_layer, dim=1), total, tuple(stats))
