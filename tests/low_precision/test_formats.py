"""E4M3 / E2M1 / E8M0 encoders against torch casts and brute force."""

from __future__ import annotations

import torch

from low_precision.formats import (
    decode_e2m1,
    decode_e4m3,
    e8m0_floor,
    e8m0_rceil,
    encode_e2m1,
    encode_e4m3,
    exp2_int,
    pack_e2m1,
    unpack_e2m1,
)
from tests.low_precision._helpers import all_bf16_values

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _random_f32_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_encode_e4m3_equals_torch_cast_on_random_bits_and_all_bf16() -> None:
    x = torch.cat([_random_f32_bits(1 << 20, 0), all_bf16_values().float().flatten()])
    finite = ~torch.isnan(x)
    ours = encode_e4m3(x)
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours[finite], theirs[finite])
    assert bool(((ours[~finite] & 0x7F) == 0x7F).all())


def test_encode_e4m3_ties_round_to_even_and_saturate() -> None:
    codes = torch.arange(0, 0x7E, dtype=torch.int32).to(torch.uint8)
    lo, hi = decode_e4m3(codes[:-1]).double(), decode_e4m3(codes[1:]).double()
    mid = ((lo + hi) / 2).float()  # exact midpoints are representable in float32
    got = encode_e4m3(mid)
    even = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    assert torch.equal(got, even)
    big = torch.tensor([448.0, 464.0, 1e9, float("inf"), -float("inf")])
    assert encode_e4m3(big).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]


def test_decode_e4m3_all_codes() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = decode_e4m3(codes)
    theirs = codes.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan].view(torch.int32), theirs[~nan].view(torch.int32))


def test_encode_e2m1_is_round_to_nearest_even_on_the_grid() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(100_000, generator=g) * 3, torch.linspace(-7, 7, 2801)]).float()
    mids = ((E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2).float()
    x = torch.cat([x, mids, -mids, torch.tensor([0.0, -0.0, 6.0, 100.0, -100.0])])
    a = x.double().abs().clamp(max=6.0)
    dist = (a[:, None] - E2M1_GRID[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    idx = torch.arange(8)[None, :].expand_as(dist)
    # ties: prefer the even code (codes 0, 2, 4, 6 have an even mantissa bit)
    tie_even = torch.where(candidates & (idx % 2 == 0), idx, 99).min(dim=1).values
    nearest = torch.where(candidates.sum(1) > 1, tie_even, torch.where(candidates, idx, 99).min(dim=1).values)
    sign = (x.view(torch.int32) < 0).to(torch.int64) * 8
    assert torch.equal(encode_e2m1(x).to(torch.int64), nearest | sign)
    assert torch.equal(decode_e2m1(encode_e2m1(x)).abs(), E2M1_GRID.float()[nearest])


def test_pack_puts_even_element_in_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_e8m0_floor_and_rceil_on_known_values() -> None:
    amax = torch.tensor([1.0, 448.0, 449.0, 0.0, float("inf"), float("nan"), 3e38, 2.0**-120])
    # FLOOR: exponent bits - 8; 1.0 -> 119, 448 -> 127; inf and NaN -> 255 (OCP; torchao gives inf 247)
    assert e8m0_floor(amax).tolist() == [119, 127, 127, 0, 255, 255, 246, 0]
    # RCEIL: ceil(log2(amax / 448)) + 127; 448 -> 127 exactly, 449 -> 128; inf and NaN -> 255 (torchao: inf 254)
    assert e8m0_rceil(amax).tolist() == [119, 127, 128, 0, 255, 255, 247, 0]
    assert e8m0_floor(-amax[4:5]).tolist() == e8m0_rceil(-amax[4:5]).tolist() == [255]


def test_exp2_int_is_exact_including_subnormals() -> None:
    p = torch.arange(-149, 128)
    expected = torch.pow(torch.tensor(2.0, dtype=torch.float64), p.double()).float()
    assert torch.equal(exp2_int(p), expected)
