"""The policy: a Qwen3-MoE-compatible MoE transformer, tokenizers, generation engine, RL losses, packing.

Single-device PyTorch; never imports the runtime or NATS. Import from the submodules, e.g.
`from model.transformer import MoETransformer`, `from model.engine import GenerationEngine`.
"""
