"""The benchmarks' peers stay honest: the model bench refuses a peer that computes a different model,
and the weight-sync bench's full uploads and seconds-per-sync rounds rebuild the weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import tiny
from model.transformer import MoETransformer
from model.weight_sync.codec import CodecConfig
from runtime.blob import open_store
from tests.bench.model import load_peer, parity, peer_implementations
from tests.bench.weight_sync import decode_full, encode_full, measure_sync


@pytest.fixture(scope="module")
def ours_and_peer(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoETransformer, torch.nn.Module]:
    directory = str(tmp_path_factory.mktemp("tiny"))
    save_checkpoint(MoETransformer(tiny()).init_weights(0), directory)
    _, ours = load_checkpoint(directory)
    return ours.eval(), load_peer(directory, attn=None, experts=None).eval()


def test_model_bench_peer_is_transformers_at_its_defaults(ours_and_peer) -> None:
    _, peer = ours_and_peer
    assert peer_implementations(peer) == {"attn": "sdpa", "experts": "grouped_mm"}


def test_model_bench_parity_holds_for_the_same_weights_and_refuses_different_ones(ours_and_peer) -> None:
    ours, peer = ours_and_peer
    ids_BL = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    checked = parity(ours, peer, ids_BL)
    assert checked["parity_max_abs_logit_diff"] < 1e-3
    assert checked["parity_loss"] == pytest.approx(checked["parity_hf_loss"], abs=1e-3)

    expert_weights = next(p for name, p in peer.named_parameters() if "experts" in name)
    with torch.no_grad():
        expert_weights.mul_(1.5)  # the peer now computes another model
    try:
        with pytest.raises(AssertionError, match="different models"):
            parity(ours, peer, ids_BL)
    finally:
        with torch.no_grad():
            expert_weights.div_(1.5)


def _states() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    previous = {f"layer{i}.weight": torch.randn(64, 96, generator=generator).bfloat16() for i in range(3)}
    latest = {name: t.clone() for name, t in previous.items()}
    latest["layer1.weight"][3, :7] += 1.0  # one small step: a few changed elements
    return [previous, latest]


def test_full_upload_round_trips_bit_exact_and_zstd_is_smaller() -> None:
    state = _states()[1]
    codec = CodecConfig(zstd_level=1, workers=2)
    raw, compressed = encode_full(state, codec, compress=False), encode_full(state, codec)
    assert len(compressed) < len(raw)
    for blob, compress in ((raw, False), (compressed, True)):
        rebuilt = decode_full(blob, compress)
        assert all(torch.equal(rebuilt[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())


async def test_sync_rounds_go_through_the_store_and_report_every_way(tmp_path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        result = await measure_sync(store, _states(), CodecConfig(zstd_level=1, workers=2), rounds=2, run="t")
        leftover = await store.list("full_")
    assert leftover == []  # the full uploads are deleted after each round
    for way in ("delta", "full_zstd", "full_raw"):
        assert result[f"{way}_s"] > 0
    assert result["full_zstd_s"] >= result["full_zstd_encode_s"] + result["full_zstd_upload_s"]
    assert 0 < result["delta_bytes"] < len(encode_full(_states()[1], CodecConfig(), compress=False))
    assert result["speedup_vs_full_zstd"] == pytest.approx(result["full_zstd_s"] / result["delta_s"])
