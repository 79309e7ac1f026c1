"""Benchmark: NVFP4 and MXFP8 grouped GEMMs (Triton) against a bf16 grouped GEMM on the same shapes.

Prints ONE JSON line: median times (ms), TFLOP/s and the ratio to bf16 for
- forward   out[m] = x[m] @ W[e]^T          bf16 torch._grouped_mm  vs  NVFP4 and MXFP8 Triton kernels
- wgrad     dW[e]  = dY_e^T @ X_e           bf16 torch._grouped_mm  vs  MXFP8 Triton kernel
Quantization is timed separately ("quant_ms") so GEMM and end-to-end cost can both be read off.
``--sweep`` times each Triton GEMM at every tile configuration of ``TILES`` and reports the fastest
(with its configuration); without it, the launchers' defaults. Without a CUDA GPU it prints a JSON line
saying so and exits 0.

    .venv/bin/python tests/bench/kernels.py [--experts 8] [--tokens 16384] [--hidden 2048] [--inter 1536] [--sweep]
    (or: python -m tests.bench.kernels)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: this file's folder would shadow the `low_precision` package
    sys.path[0] = str(Path(__file__).resolve().parents[2])


def _no_gpu(reason: str) -> int:
    print(json.dumps({"bench": "kernels", "status": "skipped", "reason": reason}))
    return 0


def _time_ms(fn, warmup: int = 5, reps: int = 30) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


# Launch parameters tried by --sweep, per GEMM; the first of each is the launcher's default.
TILES = {
    "nvfp4_fwd": [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st) for bm, bn, bk, w, st in (
        (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 256, 32, 8, 4),
        (64, 128, 64, 4, 3))],
    "mxfp8_fwd": [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st) for bm, bn, w, st in (
        (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (64, 256, 8, 3), (128, 256, 8, 4), (128, 256, 8, 3))],
    "mxfp8_wgrad": [dict(block_n=bn, block_q=bq, num_warps=w, num_stages=st) for bn, bq, w, st in (
        (64, 64, 4, 3), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 3), (256, 128, 8, 3), (128, 128, 8, 3))],
}


def _fastest(make_fn, tiles: list[dict[str, int]]) -> tuple[float, dict[str, int]]:
    """Median ms of the fastest launch configuration, and that configuration."""
    from triton.runtime.errors import OutOfResources

    timed = []
    for tile in tiles:
        try:
            timed.append((_time_ms(make_fn(tile)), tile))
        except OutOfResources:  # too large a tile for this GPU's shared memory: not a candidate
            continue
    return min(timed, key=lambda t: t[0])


def _bf16_grouped(x, w_ENK, offsets_E1):
    import torch

    ends = offsets_E1[1:].to(torch.int32)
    return lambda: torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=ends)


def _bf16_wgrad(dy, x, offsets_E1):
    import torch

    ends = offsets_E1[1:].to(torch.int32)
    dy_t = dy.t().contiguous()  # (N, M) so the grouped dim is the reduction dim
    return lambda: torch._grouped_mm(dy_t, x, offs=ends)


def run(args: argparse.Namespace) -> dict:
    import torch

    from low_precision import _backends
    from low_precision.formats import ScaleMode
    from low_precision.mxfp8 import padded_group_layout

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, m, k, n = args.experts, args.tokens, args.hidden, args.inter
    sizes = torch.full((e,), m // e, dtype=torch.int64)
    sizes[: m - int(sizes.sum())] += 1
    offsets = torch.zeros(e + 1, dtype=torch.int64)
    offsets[1:] = sizes.cumsum(0)
    offsets = offsets.to(dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    b, mode = _backends.TRITON, ScaleMode.RCEIL
    layout = padded_group_layout(offsets, m)

    xq4, wq4 = b.nvfp4_rows(x), b.nvfp4_experts(w)
    xq8, wq8 = b.mx_rows(x, mode), b.mx_experts(w, mode)
    dyc, xc = b.mx_grouped_cols(dy, layout, mode), b.mx_grouped_cols(x, layout, mode)
    poff = layout.padded_offsets_E1
    tiles = {name: configs if args.sweep else configs[:1] for name, configs in TILES.items()}
    nvfp4_fwd = _fastest(lambda kw: lambda: b.nvfp4_mm(xq4, wq4, offsets, **kw), tiles["nvfp4_fwd"])
    mxfp8_fwd = _fastest(lambda kw: lambda: b.mx_mm(xq8, wq8, offsets, **kw), tiles["mxfp8_fwd"])
    mxfp8_wgrad = _fastest(lambda kw: lambda: b.mx_wgrad(dyc, xc, poff, **kw), tiles["mxfp8_wgrad"])
    timings = {
        "bf16_fwd": _time_ms(_bf16_grouped(x, w, offsets)),
        "nvfp4_fwd": nvfp4_fwd[0],
        "mxfp8_fwd": mxfp8_fwd[0],
        "bf16_wgrad": _time_ms(_bf16_wgrad(dy, x, offsets)),
        "mxfp8_wgrad": mxfp8_wgrad[0],
    }
    from low_precision.grouped_gemm_triton import _nvfp4_unscaled

    quant = {
        # inside nvfp4_fwd: Hopper has no FP4 MMA, so both operands are first expanded to bf16
        "nvfp4_fwd_dequant_a_b": _time_ms(lambda: (_nvfp4_unscaled(xq4.packed, xq4.block_scales, True),
                                                   _nvfp4_unscaled(wq4.packed.view(e * n, -1),
                                                                   wq4.block_scales.view(e * n, -1), True))),
        "nvfp4_rows": _time_ms(lambda: b.nvfp4_rows(x)),
        "mxfp8_rows": _time_ms(lambda: b.mx_rows(x, mode)),
        "mxfp8_grouped_cols": _time_ms(lambda: b.mx_grouped_cols(dy, layout, mode)),
    }
    flops = 2.0 * m * n * k
    tflops = {name: flops / (ms * 1e-3) / 1e12 for name, ms in timings.items()}
    return {
        "bench": "kernels",
        "status": "ok",
        "device": torch.cuda.get_device_name(),
        "shape": {"experts": e, "tokens": m, "hidden_K": k, "inter_N": n},
        "median_ms": {name: round(ms, 4) for name, ms in timings.items()},
        "quant_ms": {name: round(ms, 4) for name, ms in quant.items()},
        "tflops": {name: round(v, 1) for name, v in tflops.items()},
        "tiles": {"nvfp4_fwd": nvfp4_fwd[1], "mxfp8_fwd": mxfp8_fwd[1], "mxfp8_wgrad": mxfp8_wgrad[1],
                  "swept": args.sweep},
        "ratio_vs_bf16": {
            "nvfp4_fwd": round(tflops["nvfp4_fwd"] / tflops["bf16_fwd"], 3),
            "mxfp8_fwd": round(tflops["mxfp8_fwd"] / tflops["bf16_fwd"], 3),
            "mxfp8_wgrad": round(tflops["mxfp8_wgrad"] / tflops["bf16_wgrad"], 3),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16384, help="routed (token, expert) rows")
    parser.add_argument("--hidden", type=int, default=2048, help="reduction dim K (multiple of 32)")
    parser.add_argument("--inter", type=int, default=1536, help="output dim N (multiple of 32)")
    parser.add_argument("--sweep", action="store_true", help="time every tile configuration in TILES")
    args = parser.parse_args()
    try:
        import torch
    except ImportError as exc:
        return _no_gpu(f"torch unavailable: {exc}")
    if not torch.cuda.is_available():
        return _no_gpu("no CUDA GPU available on this machine; nothing was measured")
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
