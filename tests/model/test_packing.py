"""Packing without padding and balanced assignment to data-parallel ranks."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.config import medium_100m, tiny
from model.packing import SequenceCost, assign_to_ranks, pack_sequences, split_microbatches
from tests.model.helpers import seeded_model, small_config


def test_pack_layout_and_targets() -> None:
    batch = pack_sequences([[1, 2, 3], [4], [5, 6]])
    assert batch.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6]
    assert batch.seq_lens == (3, 1, 2) and batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.targets_T[batch.target_mask_T].tolist() == [2, 3, 6]
    assert batch.target_mask_T.tolist() == [True, True, False, False, True, False]


def test_packed_forward_equals_separate_forwards() -> None:
    model = seeded_model(small_config(), seed=1)
    seqs = [torch.randint(0, 96, (n,)).tolist() for n in (7, 1, 7, 12)]
    batch = pack_sequences(seqs)
    with torch.no_grad():
        packed = model(batch.input_ids_T, seq_lens=batch.seq_lens).logits
        via_cu = model(batch.input_ids_T, cu_seqlens=batch.cu_seqlens).logits
        separate = torch.cat([model(torch.tensor(s)).logits for s in seqs])
    assert torch.allclose(packed, separate, atol=1e-5, rtol=0)
    assert torch.equal(packed, via_cu)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=64),
    num_ranks=st.integers(1, 9),
    quadratic=st.sampled_from([0.0, 1.0, 100.0]),
)
def test_assignment_is_a_partition_within_lpt_bound(lengths: list[int], num_ranks: int, quadratic: float) -> None:
    cost = SequenceCost(linear=1000.0, quadratic=quadratic)
    ranks = assign_to_ranks(lengths, num_ranks, cost)
    assert len(ranks) == num_ranks
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
    loads = [sum(cost(lengths[i]) for i in r) for r in ranks]
    costs = [cost(n) for n in lengths]
    # Graham's list-scheduling bound holds for any greedy order
    assert max(loads) <= sum(costs) / num_ranks + (1 - 1 / num_ranks) * max(costs) + 1e-6


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=8), num_ranks=st.integers(1, 3))
def test_assignment_within_four_thirds_of_brute_force_optimum(lengths: list[int], num_ranks: int) -> None:
    cost = SequenceCost(linear=1000.0, quadratic=1.0)
    costs = [cost(n) for n in lengths]
    best = min(
        max(sum(c for c, r in zip(costs, assign, strict=True) if r == rank) for rank in range(num_ranks))
        for assign in itertools.product(range(num_ranks), repeat=len(costs))
    )
    loads = [sum(costs[i] for i in r) for r in assign_to_ranks(lengths, num_ranks, cost)]
    assert max(loads) <= best * 4 / 3 + 1e-6


def test_quadratic_term_changes_the_balance() -> None:
    """One long sequence costs more than many short ones of the same total length."""
    lengths = [4096] + [512] * 12
    linear_only = assign_to_ranks(lengths, 2, SequenceCost(1.0, 0.0))
    with_attention = assign_to_ranks(lengths, 2, SequenceCost.for_model(medium_100m()))
    long_rank = next(r for r in with_attention if 0 in r)
    assert long_rank == [0]  # the long sequence's attention cost outweighs all short ones
    assert len(next(r for r in linear_only if 0 in r)) > 1
    assert SequenceCost.for_model(tiny()).quadratic > 0


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), budget=st.integers(1, 600))
def test_microbatches_respect_budget(lengths: list[int], budget: int) -> None:
    batches = split_microbatches(range(len(lengths)), lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= budget
