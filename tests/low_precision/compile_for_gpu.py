"""Compile every Triton kernel of low_precision/ for a GPU architecture, on a machine without one.

The interpreter (what CI runs) accepts code that the compiler rejects (an early return in a
``constexpr`` branch, a NaN global), so tests/low_precision/test_compile_for_gpu.py runs this in a fresh
process with TRITON_INTERPRET unset. Each kernel is compiled for every specialization its launcher
makes (dtypes, scale modes, GPU paths); the block sizes are the launchers' defaults.

    python -m tests.low_precision.compile_for_gpu [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

F32, I16, U8, I32, I64 = "*fp32", "*i16", "*u8", "*i32", "*i64"
TILE_MAP = {"tile_expert_ptr": I32, "tile_start_ptr": I32, "tile_end_ptr": I32}


def _variants():
    """(kernel, pointer types by argument, constexprs): every specialization the launchers use."""
    from low_precision import grouped_gemm_triton as gg
    from low_precision import mxfp8_triton as mx
    from low_precision import nvfp4_triton as nv

    for is_bf16 in (True, False):
        x = I16 if is_bf16 else F32  # bf16 inputs travel as their int16 bits (as_loadable)
        yield nv._row_amax_kernel, {"x_ptr": x, "amax_ptr": F32}, {"BLOCK_M": 16, "BLOCK_K": 256, "IS_BF16": is_bf16}
        yield (nv._nvfp4_quant_kernel, {"x_ptr": x, "amax_ptr": F32, "packed_ptr": U8, "scales_ptr": U8,
                                        "global_ptr": F32}, {"BLOCK_M": 16, "BLOCKS": 8, "IS_BF16": is_bf16})
        for rceil in (True, False):
            yield (mx._mxfp8_rows_kernel, {"x_ptr": x, "codes_ptr": U8, "scales_ptr": U8},
                   {"BLOCK_M": 16, "BLOCKS": 8, "IS_RCEIL": rceil, "IS_BF16": is_bf16})
            yield (mx._mxfp8_grouped_cols_kernel, {"x_ptr": x, "src_rows_ptr": I64, "codes_ptr": U8, "scales_ptr": U8},
                   {"BLOCKS": 4, "BLOCK_N": 64, "IS_RCEIL": rceil, "IS_BF16": is_bf16})
    for to_bf16 in (True, False):
        yield (gg._nvfp4_dequant_kernel, {"packed_ptr": U8, "scales_ptr": U8, "out_ptr": "*bf16" if to_bf16 else F32},
               {"BLOCK_R": 16, "BLOCK_PAIRS": 128, "TO_BF16": to_bf16})
    for even_k in (True, False):
        yield (gg._nvfp4_grouped_mm_kernel, {"a_ptr": "*bf16", "a_amax_ptr": F32, "b_ptr": "*bf16", "b_amax_ptr": F32,
                                             "out_ptr": F32, **TILE_MAP},
               {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "EVEN_K": even_k})
    yield (gg._mxfp8_grouped_mm_kernel, {"a_ptr": U8, "a_scale_ptr": U8, "b_ptr": U8, "b_scale_ptr": U8,
                                         "out_ptr": F32, **TILE_MAP},
           {"BLOCK_M": 64, "BLOCK_N": 128, "ON_GPU": True})
    yield (gg._mxfp8_grouped_wgrad_kernel, {"g_ptr": U8, "g_scale_ptr": U8, "x_ptr": U8, "x_scale_ptr": U8,
                                            "out_ptr": F32, "padded_offsets_ptr": I64},
           {"BLOCK_N": 64, "BLOCK_Q": 64, "ON_GPU": True})


def compile_all(arch: int) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    compiled = []
    for kernel, pointers, constexprs in _variants():
        if not isinstance(kernel, triton.runtime.JITFunction):
            raise RuntimeError("the kernels were imported interpreted; unset TRITON_INTERPRET")
        names = kernel.arg_names
        unknown = (set(pointers) | set(constexprs)) - set(names)
        if unknown:
            raise RuntimeError(f"{kernel.__name__} has no arguments {sorted(unknown)}: update this script")
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
        source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()})
        started = time.perf_counter()
        binary = triton.compile(source, target=target)
        compiled.append({"kernel": kernel.__name__, **constexprs, "cubin_bytes": len(binary.asm["cubin"]),
                         "s": round(time.perf_counter() - started, 2)})
    return compiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        print("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled; unset it", file=sys.stderr)
        return 2
    for row in compile_all(args.arch):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
