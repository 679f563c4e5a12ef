"""Time the exact forms of the mixture-of-experts product (`tx.models.moe`): `ragged` (pairs sorted by
expert, `jax.lax.ragged_dot`), `dense` (every expert on every token) and `blocked` (pairs sorted by expert,
padded per expert to blocks, one matmul per used block; blocks of the height the engine picks for the call,
`tx.models.moe.block_height`: 128 rows in training and prefill, 4-16 in the 32-token decode); prints JSON.

One MoE block's routed experts (router excluded: both forms share it) on N tokens of width D, X experts of
width F, k per token, for a training step (forward and backward of the inputs and the expert weights) and
a forward pass (prefill, decode). Each line is one case: milliseconds per call (best of `--reps`) and the
GFLOP/s and fraction of this machine's float32 matmul peak counted on *active* FLOPs (what the k chosen
experts cost, 6 N k D F forward, 3x that for a training step). The peak is measured in the same run
(the best of a large square matmul). The last line names the faster form per case and the largest expert
count at which `dense` beat `ragged` in every workload: `Tuning.moe_dense_max_experts` for this backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import matmul_peak, timed  # noqa: E402
from run_all import machine  # noqa: E402

from tx.models.moe import FORMS, block_height, blocked_experts, route  # noqa: E402

WORKLOADS = {"train": 2048, "prefill": 2048, "decode": 32}  # tokens per call
TIMED = ("ragged", "dense", "blocked")  # `pairs` (a call of at most X pairs, unrolled) has no case here


def inputs(N: int, D: int, F: int, X: int, k: int) -> tuple:
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (N, D), jnp.float32)
    routing = route(jax.random.normal(keys[1], (N, X)), k, normalize=True)
    gate, up = (jax.random.normal(key, (X, F, D)) / np.sqrt(D) for key in keys[2:4])
    down = jax.random.normal(keys[4], (X, D, F)) / np.sqrt(F)
    return x, routing, (gate, up, down)


def program(form: str, workload: str, X: int, k: int) -> Callable:
    product = FORMS[form]
    if form == "blocked":  # in the blocks the engine would use for this call (`SparseMoeBlock.form_for`)
        product = functools.partial(blocked_experts, rows=block_height(WORKLOADS[workload] * k, X, 128))
    if workload != "train":
        return jax.jit(product)

    def loss(x: jax.Array, routing: Any, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
        return jnp.sum(product(x, routing, gate, up, down) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


def measure(workload: str, D: int, F: int, X: int, k: int, reps: int, peak: float) -> list[dict[str, Any]]:
    N = WORKLOADS[workload]
    x, routing, weights = inputs(N, D, F, X, k)
    active = 6 * N * k * D * F * (3 if workload == "train" else 1)
    records = []
    for form in TIMED:
        fn = program(form, workload, X, k)
        ms = timed(lambda fn=fn: fn(x, routing, *weights), reps)
        gflops = active / ms / 1e6
        records.append(
            {"workload": workload, "form": form, "N": N, "D": D, "F": F, "X": X, "k": k, "ms": round(ms, 3),
             "active_gflops_per_s": round(gflops, 1), "fraction_of_peak": round(gflops / peak, 3)}
        )  # fmt: skip
    return records


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest form per (workload, X), and the largest X up to which dense beat ragged in every workload."""

    def faster(key: str, forms: tuple[str, ...]) -> str:
        cases = [o for o in records if f"{o['workload']}/X={o['X']}" == key and o["form"] in forms]
        return min(cases, key=lambda o: o["ms"])["form"]

    keys = sorted({f"{r['workload']}/X={r['X']}" for r in records})
    winners = {key: faster(key, TIMED) for key in keys}
    dense_max = 0
    for X in sorted({r["X"] for r in records}):
        if any(faster(k, ("dense", "ragged")) != "dense" for k in keys if k.endswith(f"/X={X}")):
            break
        dense_max = X
    return {"winner": winners, "moe_dense_max_experts": dense_max}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI smoke size: small widths, two expert counts")
    parser.add_argument("--embed", type=int, default=512, help="D, the token width")
    parser.add_argument("--expert-size", type=int, default=384, help="F, one expert's width")
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 32], help="X values")
    parser.add_argument("--top-k", type=int, default=2, help="k, experts per token")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    D, F, counts, reps, peak_size = args.embed, args.expert_size, args.experts, args.reps, 2048
    if args.quick:
        D, F, counts, reps, peak_size = 64, 32, [4, 8], 2, 256
        WORKLOADS.update(train=128, prefill=128, decode=8)
    peak = matmul_peak(peak_size, reps)
    print(json.dumps({"fp32_matmul_peak_gflops_per_s": round(peak, 1), "peak_matmul_size": peak_size}), flush=True)
    records = []
    for X in counts:
        for workload in args.workloads:
            for record in measure(workload, D, F, X, args.top_k, reps, peak):
                print(json.dumps(record), flush=True)
                records.append(record)
    print(json.dumps({"summary": summarise(records), "machine": machine(), "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
