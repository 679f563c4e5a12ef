"""Bucketing, first-fit-decreasing packing, pack/unpack round trips, micro-batch budgets and padding waste."""

import numpy as np
import pytest

from tx.engine.batching import (
    DEFAULT_BUCKETS,
    LENGTH_BUCKETS,
    PackPlan,
    bucket_size,
    geometric_buckets,
    micro_batches,
    pack,
    pack_sequences,
    unpack,
)


def _uniform_lengths(num_datums: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 1001, num_datums).tolist()


def test_buckets_are_powers_of_two_times_one_and_a_half() -> None:
    assert DEFAULT_BUCKETS[:10] == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert LENGTH_BUCKETS[:5] == (128, 192, 256, 384, 512)
    assert geometric_buckets(3, 20) == (3, 4, 6, 8, 12, 16, 20)
    assert [bucket_size(n) for n in (1, 5, 8, 9, 33)] == [1, 6, 8, 12, 48]
    assert bucket_size(129, LENGTH_BUCKETS) == 192
    with pytest.raises(ValueError):
        bucket_size(21, geometric_buckets(3, 20))


def _check_layout(plan: PackPlan) -> None:
    """Every datum once; segments within their row, disjoint; ids and positions as documented."""
    seen = []
    for batch in plan.batches:
        occupied = np.zeros(batch.shape, bool)
        for s in batch.segments:
            assert s.row < batch.num_rows and s.start + s.length <= batch.row_tokens
            assert plan.lengths[s.datum] == s.length and not occupied[s.row, s.start : s.start + s.length].any()
            occupied[s.row, s.start : s.start + s.length] = True
            ids = batch.segment_ids[s.row, s.start : s.start + s.length]
            assert ids.min() == ids.max() > 0
            np.testing.assert_array_equal(batch.positions[s.row, s.start : s.start + s.length], np.arange(s.length))
            seen.append(s.datum)
        np.testing.assert_array_equal(batch.segment_ids == 0, ~occupied)
        np.testing.assert_array_equal(batch.positions[~occupied], 0)
    assert sorted(seen) == [i for i, length in enumerate(plan.lengths) if length > 0]


def test_segments_and_positions_restart_per_sequence() -> None:
    plan = pack_sequences([3, 5, 2, 4], row_tokens=8)
    assert [b.shape for b in plan.batches] == [(2, 8)]
    (batch,) = plan.batches
    # Decreasing order: 5 opens row 0, 4 opens row 1, 3 joins row 0, 2 joins row 1.
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]])
    _check_layout(plan)


def test_overlong_sequence_gets_a_wider_row_that_still_takes_short_ones() -> None:
    plan = pack_sequences([100, 300, 20, 80], row_tokens=128)
    assert [b.shape for b in plan.batches] == [(1, 128), (1, 384)]
    assert {s.datum for s in plan.batches[1].segments} == {1, 3}  # 300 opens it, 80 fills it
    _check_layout(plan)


def test_pack_unpack_round_trip_in_request_order() -> None:
    lengths = [*_uniform_lengths(40, seed=1), 0, 2500]
    plan = micro_batches(pack_sequences(lengths, row_tokens=2048), max_tokens=8192)
    _check_layout(plan)
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 50_000, n).astype(np.int32) for n in lengths]
    weights = [rng.random((n, 2)).astype(np.float32) for n in lengths]
    packed_tokens, packed_weights = pack(tokens, plan, fill=-1), pack(weights, plan)
    for batch, packed in zip(plan.batches, packed_tokens, strict=True):
        assert packed.shape == batch.shape and packed.dtype == np.int32
        np.testing.assert_array_equal(packed == -1, batch.segment_ids == 0)
    for original, restored in zip(tokens, unpack(packed_tokens, plan), strict=True):
        np.testing.assert_array_equal(original, restored)
    for original, restored in zip(weights, unpack(packed_weights, plan), strict=True):
        np.testing.assert_array_equal(original, restored)
    assert unpack(packed_weights, plan)[40].shape == (0, 2)


def test_micro_batches_respect_the_budget_with_bucketed_rows() -> None:
    lengths = [*_uniform_lengths(300, seed=4), 3000, 5000]
    plan = pack_sequences(lengths, row_tokens=1024)
    for max_tokens in (1024, 6000, 16384):
        pieces = micro_batches(plan, max_tokens)
        _check_layout(pieces)
        for batch in pieces.batches:
            assert batch.num_rows in DEFAULT_BUCKETS
            assert batch.num_rows * batch.row_tokens <= max_tokens or batch.num_rows == 1
        assert len({b.shape for b in pieces.batches}) <= 2 * len(plan.batches)


@pytest.mark.parametrize("num_datums", [64, 128, 1024])
def test_padding_waste_below_ten_percent(num_datums: int) -> None:
    """Lengths uniform in 100..1000, default 2048-token rows and 16k-token micro-batches, 10 draws each."""
    wastes = [micro_batches(pack_sequences(_uniform_lengths(num_datums, seed))).waste for seed in range(10)]
    print(f"padding waste, {num_datums} datums: mean {np.mean(wastes):.2%}, max {np.max(wastes):.2%}")
    assert max(wastes) < 0.10


def test_a_lone_datum_round_trips_with_zero_padding() -> None:
    """One datum, one batch: the shapes and dtypes of pack and unpack come from the only entry there is."""
    plan = pack_sequences([5], row_tokens=8)
    values = np.arange(1, 11, dtype=np.float32).reshape(5, 2)
    (packed,) = pack([values], plan)
    assert packed.shape == (1, 8, 2) and packed.dtype == np.float32
    np.testing.assert_array_equal(packed[0, 5:], 0)  # the default fill
    (restored,) = unpack([packed], plan)
    np.testing.assert_array_equal(restored, values)


def test_a_sequence_as_long_as_the_row_takes_a_plain_row() -> None:
    plan = pack_sequences([8, 3, 5], row_tokens=8)
    assert [b.shape for b in plan.batches] == [(2, 8)]
    _check_layout(plan)


def test_waste_counts_the_padding_slots() -> None:
    plan = pack_sequences([3, 5, 2, 4], row_tokens=8)  # 14 tokens in two rows of 8
    assert plan.padded_tokens == 16 and plan.waste == pytest.approx(2 / 16)
    assert micro_batches(plan, max_tokens=8).padded_tokens == 16  # one row per piece, no padded rows


def test_the_ladders_end_at_a_million_tokens() -> None:
    """The largest shape a request can compile; one token more is refused by name."""
    for ladder in (DEFAULT_BUCKETS, LENGTH_BUCKETS):
        assert bucket_size(1 << 20, ladder) == 1 << 20
        with pytest.raises(ValueError, match="exceeds the largest bucket 1048576"):
            bucket_size((1 << 20) + 1, ladder)
