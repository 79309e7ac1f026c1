"""The NVFP4 Triton kernels must use IEEE division (``tl.div_rn``) and no approximate math.

On NVIDIA GPUs ``/`` on fp32 compiles to an approximate division (up to 2 ulp) that flips FP4 codes
and E4M3 scales; the interpreter computes ``/`` and ``div_rn`` identically, so only the source can
show the difference. This test reads the source of every jitted function on the NVFP4 paths.
"""

from __future__ import annotations

import inspect
import io
import textwrap
import tokenize

import pytest

from low_precision import _triton_formats, grouped_gemm_triton, nvfp4_triton

BANNED_NAMES = {"fdiv", "fast_dividef", "fast_expf", "fast_logf", "inline_asm_elementwise", "rsqrt"}
BANNED_TEXT = ("approx", "div.full", "ftz")


def division_violations(source: str) -> list[str]:
    """Bare ``/`` or ``/=`` operators and approximate-math names in Python source (comments, strings
    and floor division ``//`` are fine)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
        if tok.type == tokenize.OP and tok.string in ("/", "/="):
            found.append(f"line {tok.start[0]}: bare '{tok.string}' in {tok.line.strip()!r}")
        if tok.type == tokenize.NAME and tok.string in BANNED_NAMES:
            found.append(f"line {tok.start[0]}: approximate math {tok.string!r}")
        if tok.type == tokenize.STRING and any(t in tok.string for t in BANNED_TEXT):
            found.append(f"line {tok.start[0]}: approximate PTX in {tok.string!r}")
    return found


def _jitted(module) -> dict[str, object]:
    return {name: obj for name, obj in vars(module).items() if hasattr(obj, "fn") and callable(obj.fn)}


NVFP4_KERNELS = {
    **{f"nvfp4_triton.{n}": k for n, k in _jitted(nvfp4_triton).items()},
    **{f"_triton_formats.{n}": k for n, k in _jitted(_triton_formats).items()},
    "grouped_gemm_triton._nvfp4_dequant_kernel": grouped_gemm_triton._nvfp4_dequant_kernel,
    "grouped_gemm_triton._nvfp4_grouped_mm_kernel": grouped_gemm_triton._nvfp4_grouped_mm_kernel,
}


def test_the_checker_catches_bare_division() -> None:
    bad = "def k(x, y):\n    z = x / y  # ok comment /\n    z /= 2\n    return tl.math.fdiv(z, y)\n"
    assert len(division_violations(bad)) == 3
    good = "def k(x, y):\n    n = x // 2  # a / b in a comment\n    s = 'a/b'\n    return tl.div_rn(x, y)\n"
    assert division_violations(good) == []


def test_nvfp4_kernel_set_is_complete() -> None:
    names = set(NVFP4_KERNELS)
    for required in ("_nvfp4_quant_kernel", "_nvfp4_encode_scale", "encode_e4m3", "encode_e2m1", "decode_e2m1"):
        assert any(n.endswith("." + required) for n in names), required


@pytest.mark.parametrize("name", sorted(NVFP4_KERNELS))
def test_nvfp4_kernels_have_no_bare_division(name: str) -> None:
    source = inspect.getsource(NVFP4_KERNELS[name].fn)
    assert division_violations(source) == [], name


def test_ieee_division_is_used_where_nvfp4_divides() -> None:
    quant = inspect.getsource(nvfp4_triton._nvfp4_encode_scale.fn) + inspect.getsource(
        nvfp4_triton._nvfp4_quant_kernel.fn
    )
    assert quant.count("tl.div_rn(") >= 2  # S_enc = 2688 / amax and enc = S_enc / dec
    assert "tl.div_rn(" in inspect.getsource(grouped_gemm_triton._nvfp4_grouped_mm_kernel.fn)
