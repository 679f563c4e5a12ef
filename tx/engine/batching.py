"""Host-side padding, bucketing and sequence packing (numpy only): every static shape the engine compiles.

Sizes come from one small geometric ladder, powers of two times {1, 1.5} (1, 2, 3, 4, 6, 8, 12, 16, ...):
at most two sizes per octave, so a workload compiles a handful of shapes, and rounding up to the next
size wastes under a third in the worst case and about a sixth on average. Sequence lengths use the rungs
from 128 upwards (multiples of 64, friendly to accelerator tiles); row counts and decode batches use all.

Training sequences are not padded one per row: `pack_sequences` packs them first-fit-decreasing into
rows of a fixed token budget T. A row holds whole sequences back to back; `segment_ids` number them
1, 2, ... within the row (0 is padding) and `positions` restart at 0 in each, so attention masked by
segment equality and rotary positions see each sequence as if it were alone. A sequence longer than T
opens a row of its own, of the next length bucket, whose space is still offered to shorter sequences.
Rows of one width form one `PackedBatch`; `micro_batches` cuts those into pieces of at most `max_tokens`
tokens with a bucketed row count. `pack` scatters per-datum arrays into the batches and `unpack` gathers
per-token outputs back into datum order.
"""

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def geometric_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Sizes 2^i and 3·2^(i-1) between `smallest` and `largest`, with `largest` itself last."""
    sizes = {largest}
    power = 1
    while power <= largest:
        sizes.update(size for size in (power, 3 * power // 2) if smallest <= size <= largest)
        power *= 2
    return tuple(sorted(sizes))


DEFAULT_BUCKETS = geometric_buckets(1, 1 << 20)
LENGTH_BUCKETS = geometric_buckets(128, 1 << 20)
DEFAULT_ROW_TOKENS = 2048
DEFAULT_MICRO_BATCH_TOKENS = 16384


def bucket_size(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds `n`; `buckets` must be sorted ascending."""
    index = bisect.bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


@dataclass(frozen=True)
class Segment:
    """Datum `datum` occupies tokens [start, start + length) of row `row` of its batch."""

    datum: int
    row: int
    start: int
    length: int


@dataclass(frozen=True)
class PackedBatch:
    """Rows [R, T] holding `segments`; rows without segments are padding."""

    num_rows: int
    row_tokens: int
    segments: tuple[Segment, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.row_tokens

    @property
    def num_tokens(self) -> int:
        return sum(segment.length for segment in self.segments)

    @cached_property
    def segment_ids(self) -> np.ndarray:
        """[R, T] int32: 1, 2, ... per sequence within a row, 0 on padding."""
        ids_RT = np.zeros(self.shape, np.int32)
        for segment in self.segments:
            row_RT = ids_RT[segment.row]
            row_RT[segment.start : segment.start + segment.length] = row_RT.max() + 1
        return ids_RT

    @cached_property
    def positions(self) -> np.ndarray:
        """[R, T] int32: 0, 1, ... from the start of each sequence, 0 on padding."""
        positions_RT = np.zeros(self.shape, np.int32)
        for segment in self.segments:
            positions_RT[segment.row, segment.start : segment.start + segment.length] = np.arange(segment.length)
        return positions_RT


@dataclass(frozen=True)
class PackPlan:
    """Where each datum's tokens live: `batches` of distinct or repeated shapes; `lengths` per datum."""

    batches: tuple[PackedBatch, ...]
    lengths: tuple[int, ...]

    @property
    def padded_tokens(self) -> int:
        return sum(batch.num_rows * batch.row_tokens for batch in self.batches)

    @property
    def waste(self) -> float:
        """Fraction of the padded token slots that hold padding."""
        return 1.0 - sum(self.lengths) / max(self.padded_tokens, 1)


def pack_sequences(
    lengths: Sequence[int], row_tokens: int = DEFAULT_ROW_TOKENS, length_buckets: Sequence[int] = LENGTH_BUCKETS
) -> PackPlan:
    """First-fit-decreasing packing of sequences of `lengths` into rows of `row_tokens` tokens.

    A sequence longer than `row_tokens` opens a row of `bucket_size(length, length_buckets)` tokens.
    Returns one batch per row width, the `row_tokens` batch first; row counts are exact, not bucketed.
    """
    if any(length < 0 for length in lengths):
        raise ValueError("sequence lengths must be non-negative")
    capacity: list[int] = []
    free = np.zeros(0, np.int64)
    placed: list[list[Segment]] = []
    for datum in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[datum]
        if length == 0:
            continue
        fits = np.flatnonzero(free >= length)
        if len(fits):
            row = int(fits[0])
        else:
            row = len(capacity)
            capacity.append(row_tokens if length <= row_tokens else bucket_size(length, length_buckets))
            free = np.append(free, capacity[-1])
            placed.append([])
        placed[row].append(Segment(datum, row, int(capacity[row] - free[row]), length))
        free[row] -= length
    return PackPlan(_group_rows(capacity, placed), tuple(lengths))


def _group_rows(capacity: list[int], placed: list[list[Segment]]) -> tuple[PackedBatch, ...]:
    """One batch per row width, rows renumbered within their batch."""
    batches = []
    for width in sorted(set(capacity)):
        rows = [row for row, cap in enumerate(capacity) if cap == width]
        segments = [
            Segment(s.datum, new_row, s.start, s.length) for new_row, row in enumerate(rows) for s in placed[row]
        ]
        batches.append(PackedBatch(len(rows), width, tuple(segments)))
    return tuple(batches)


def micro_batches(
    plan: PackPlan, max_tokens: int = DEFAULT_MICRO_BATCH_TOKENS, row_buckets: Sequence[int] = DEFAULT_BUCKETS
) -> PackPlan:
    """The same placement cut into batches of at most `max_tokens` padded tokens, row counts bucketed.

    Each batch of width T yields full pieces of the largest bucketed row count that fits the budget, then
    one remainder piece rounded up to its bucket. A single row wider than `max_tokens` is its own piece.
    """
    pieces = []
    for batch in plan.batches:
        fitting = max(max_tokens // batch.row_tokens, 1)
        rows_per_piece = row_buckets[max(bisect.bisect_right(row_buckets, fitting) - 1, 0)]
        for first in range(0, batch.num_rows, rows_per_piece):
            rows = min(rows_per_piece, batch.num_rows - first)
            segments = tuple(
                Segment(s.datum, s.row - first, s.start, s.length)
                for s in batch.segments
                if first <= s.row < first + rows
            )
            pieces.append(PackedBatch(bucket_size(rows, row_buckets), batch.row_tokens, segments))
    return PackPlan(tuple(pieces), plan.lengths)


def halve_rows(batch: PackedBatch, lengths: tuple[int, ...]) -> tuple[PackedBatch, ...]:
    """`batch`'s rows in batches of at most half as many (row counts bucketed), or () when one row holds all
    its segments: what a batch too large for the memory free runs as."""
    used = max((segment.row for segment in batch.segments), default=0) + 1
    if used <= 1:
        return ()
    pieces = micro_batches(PackPlan((batch,), lengths), batch.row_tokens * ((used + 1) // 2))
    return tuple(piece for piece in pieces.batches if piece.segments)


def pack(per_datum: Sequence[np.ndarray], plan: PackPlan, fill: float | int = 0) -> list[np.ndarray]:
    """Scatter per-datum arrays [length_i, ...] into one [R, T, ...] array per batch, `fill` elsewhere."""
    if len(per_datum) != len(plan.lengths):
        raise ValueError(f"expected {len(plan.lengths)} datums, got {len(per_datum)}")
    if not per_datum:
        return []
    sample = np.asarray(per_datum[0])
    packed = []
    for batch in plan.batches:
        out = np.full((*batch.shape, *sample.shape[1:]), fill, dtype=sample.dtype)
        for s in batch.segments:
            out[s.row, s.start : s.start + s.length] = per_datum[s.datum]
        packed.append(out)
    return packed


def unpack(per_token: Sequence[np.ndarray], plan: PackPlan) -> list[np.ndarray]:
    """Gather per-token outputs (one [R, T, ...] array per batch of `plan`) back into per-datum arrays."""
    if len(per_token) != len(plan.batches):
        raise ValueError(f"expected {len(plan.batches)} batch outputs, got {len(per_token)}")
    trailing = per_token[0].shape[2:] if per_token else ()
    dtype = per_token[0].dtype if per_token else np.float32
    out = [np.zeros((0, *trailing), dtype) for _ in plan.lengths]
    for batch, values in zip(plan.batches, per_token, strict=True):
        if values.shape[:2] != batch.shape:
            raise ValueError(f"batch output of shape {values.shape} does not match {batch.shape}")
        for s in batch.segments:
            out[s.datum] = np.asarray(values[s.row, s.start : s.start + s.length])
    return out
