"""Host-side assembly of training batches: datums of one or more runs -> packed `TrainBatch`es.

Sequences are packed into rows of a bucketed width (segment ids, positions restart per segment);
a row holds datums of one run only, because a row carries one adapter slot. Rows are cut into
micro-batches by a token budget with bucketed row counts, and datum counts are bucketed too, so the
set of compiled shapes stays small. `scatter_outputs` maps per-token results back to datums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from tx.engine import losses
from tx.engine.batching import (
    LENGTH_BUCKETS,
    PackedBatch,
    PackPlan,
    Segment,
    bucket_size,
    micro_batches,
    pack_sequences,
)
from tx.engine.losses import LossInputs
from tx.engine.train_step import TrainBatch
from tx.lora.select import select
from tx.protocol import Datum, ForwardBackwardRequest, ForwardBackwardResult

MAX_EXPERT_FRACTION = "moe/max_expert_fraction:max"  # a MoE model's router balance per forward_backward


@dataclasses.dataclass(frozen=True)
class Example:
    """One datum ready for packing: inputs aligned so position i predicts targets[i]."""

    tokens: np.ndarray  # [n] int32
    targets: np.ndarray  # [n, K] int32
    weights: np.ndarray  # [n, K] float32
    advantages: np.ndarray  # [n]
    sampling_logprobs: np.ndarray  # [n]
    ratio_mask: np.ndarray  # [n]
    kind: int
    config: list[float]
    slot: int
    trains: bool = True  # False: a forward request's datum (outputs only, no gradient)

    @property
    def length(self) -> int:
        return len(self.tokens)


def make_example(datum: Datum, loss_fn: str, config: dict, slot: int, trains: bool = True) -> Example:
    inputs = datum.loss_fn_inputs
    n = len(datum.tokens)
    targets = np.asarray(inputs["target_tokens"], np.int32)
    targets = targets.reshape(n, -1)
    weights = np.asarray(inputs["weights"], np.float32).reshape(n, -1) if "weights" in inputs else None
    if weights is None:
        weights = np.ones_like(targets, np.float32)
    zeros = np.zeros(n, np.float32)
    return Example(
        tokens=np.asarray(datum.tokens, np.int32),
        targets=targets,
        weights=weights,
        advantages=np.asarray(inputs.get("advantages", zeros), np.float32).reshape(n),
        sampling_logprobs=np.asarray(inputs.get("logprobs", zeros), np.float32).reshape(n),
        ratio_mask=np.asarray(inputs.get("sequence_ratio_mask", zeros), np.float32).reshape(n),
        kind=losses.loss_index(loss_fn),
        config=losses.config_row(loss_fn, config),
        slot=slot,
        trains=trains,
    )


def plan_rows(examples: Sequence[Example], max_tokens: int) -> PackPlan:
    """Pack each slot's examples separately (a row has one adapter), then cut into micro-batches."""
    longest = max(e.length for e in examples)
    row_tokens = bucket_size(max(longest, 1), LENGTH_BUCKETS)
    by_width: dict[int, list[list[Segment]]] = {}
    for slot in sorted({e.slot for e in examples}):
        members = [i for i, e in enumerate(examples) if e.slot == slot]
        plan = pack_sequences([examples[i].length for i in members], row_tokens)
        for batch in plan.batches:
            rows = by_width.setdefault(batch.row_tokens, [])
            base = len(rows)
            rows.extend([] for _ in range(batch.num_rows))
            for s in batch.segments:
                rows[base + s.row].append(Segment(members[s.datum], base + s.row, s.start, s.length))
    batches = tuple(
        PackedBatch(len(rows), width, tuple(s for row in rows for s in row)) for width, rows in sorted(by_width.items())
    )
    return micro_batches(PackPlan(batches, tuple(e.length for e in examples)), max_tokens)


def slot_parts(examples: Sequence[Example], batch: PackedBatch) -> tuple[PackedBatch, ...]:
    """`batch` as one batch per adapter slot (a row holds one slot), rows renumbered, row counts bucketed."""
    parts = []
    for slot in sorted({examples[s.datum].slot for s in batch.segments}):
        rows = sorted({s.row for s in batch.segments if examples[s.datum].slot == slot})
        new = {row: i for i, row in enumerate(rows)}
        segments = tuple(Segment(s.datum, new[s.row], s.start, s.length) for s in batch.segments if s.row in new)
        parts.append(PackedBatch(bucket_size(len(rows)), batch.row_tokens, segments))
    return tuple(parts)


def build_batch(examples: Sequence[Example], batch: PackedBatch, scale: np.ndarray) -> tuple[TrainBatch, list[int]]:
    """The device inputs for one packed micro-batch, and the datum index of each local datum slot."""
    R, T = batch.shape
    K = max(examples[s.datum].targets.shape[1] for s in batch.segments)
    datums = sorted({s.datum for s in batch.segments})
    local = {d: i for i, d in enumerate(datums)}
    D = bucket_size(max(len(datums), 1))
    tokens, targets = np.zeros((R, T), np.int32), np.zeros((R, T, K), np.int32)
    weights = np.zeros((R, T, K), np.float32)
    per_token = {name: np.zeros((R, T), np.float32) for name in ("advantages", "sampling_logprobs", "ratio_mask")}
    datum_of, valid = np.zeros((R, T), np.int32), np.zeros((R, T), bool)
    slot = np.zeros((R,), np.int32)
    kind, config = np.zeros((D,), np.int32), np.zeros((D, len(losses.CONFIG_COLUMNS)), np.float32)
    trains = np.zeros((D,), bool)
    for s in batch.segments:
        e, span = examples[s.datum], slice(s.start, s.start + s.length)
        k = e.targets.shape[1]
        tokens[s.row, span], targets[s.row, span, :k], weights[s.row, span, :k] = e.tokens, e.targets, e.weights
        for name, arr in per_token.items():
            arr[s.row, span] = getattr(e, name)
        datum_of[s.row, span], valid[s.row, span], slot[s.row] = local[s.datum], True, e.slot
        kind[local[s.datum]], config[local[s.datum]], trains[local[s.datum]] = e.kind, e.config, e.trains
    dev = jnp.asarray
    loss = LossInputs(
        datum=dev(datum_of.reshape(-1)),
        valid=dev(valid.reshape(-1)),
        weights=dev(weights.reshape(R * T, K)),
        advantages=dev(per_token["advantages"].reshape(-1)),
        sampling_logprobs=dev(per_token["sampling_logprobs"].reshape(-1)),
        ratio_mask=dev(per_token["ratio_mask"].reshape(-1)),
        kind=dev(kind),
        config=dev(config),
        trains=dev(trains),
    )
    adapters = select(slot, scale)
    out = TrainBatch(dev(tokens), dev(batch.positions), dev(batch.segment_ids), dev(targets), adapters, loss)
    return out, datums


def scatter_outputs(
    batch: PackedBatch, target_logprobs: np.ndarray, token_loss: np.ndarray, into: dict[int, dict[str, np.ndarray]]
) -> None:
    """Per-token outputs [N, K] / [N] of one micro-batch -> per-datum `logprobs` / `elementwise_loss`."""
    R, T = batch.shape
    lp = target_logprobs.reshape(R, T, -1)
    loss = token_loss.reshape(R, T)
    for s in batch.segments:
        span = slice(s.start, s.start + s.length)
        into[s.datum] = {"logprobs": lp[s.row, span], "elementwise_loss": loss[s.row, span]}


def gather_expert_load(batch: PackedBatch, picks: np.ndarray, experts: int, into: dict[int, dict]) -> None:
    """One micro-batch's expert picks [L, N, k] -> each datum's token-slots per expert, `expert_load` [L, X],
    beside its outputs in `into` (`scatter_outputs` first): over its own tokens only, never padding or the
    other datums packed into its row."""
    R, T = batch.shape
    L = picks.shape[0]
    offsets = (np.arange(L) * experts)[:, None]
    for s in batch.segments:
        start = s.row * T + s.start
        flat = (picks[:, start : start + s.length].reshape(L, -1).astype(np.int64) + offsets).ravel()
        into[s.datum]["expert_load"] = np.bincount(flat, minlength=L * experts).reshape(L, experts)


def max_expert_fraction(load: np.ndarray) -> float:
    """[L, X] token-slots per expert -> the largest share of its layer's token-slots that one expert got:
    1/X when the router spreads tokens evenly, 1/k when every token picks the same expert."""
    total = load.sum(axis=1, keepdims=True)
    return float((load / np.maximum(total, 1)).max())


def request_results(
    work: Sequence[tuple[str, ForwardBackwardRequest]], examples: Sequence[Example], owner: Sequence[int], outputs: dict
) -> list[ForwardBackwardResult]:
    """Per request: its datums' outputs; metrics `loss:sum` and, for a MoE model, the router's balance
    `moe/max_expert_fraction:max` (`train_batch.max_expert_fraction` of the request's tokens)."""
    results = []
    for index, (_, req) in enumerate(work):
        per_datum: list[dict[str, np.ndarray]] = []
        total = 0.0
        loads = []
        for d in (d for d, o in enumerate(owner) if o == index):
            out = outputs[d]
            if "expert_load" in out:
                loads.append(out["expert_load"])
            k = examples[d].targets.shape[1]
            one_d = np.asarray(req.data[len(per_datum)].loss_fn_inputs["target_tokens"]).ndim == 1
            lp = out["logprobs"][:, 0] if one_d else out["logprobs"][:, :k]
            per_datum.append({"logprobs": lp.astype(np.float32), "elementwise_loss": out["elementwise_loss"]})
            total += float(out["elementwise_loss"].sum())
        metrics = {"loss:sum": total}
        if loads:
            metrics[MAX_EXPERT_FRACTION] = max_expert_fraction(sum(loads))
        results.append(ForwardBackwardResult(per_datum, metrics))
    return results
