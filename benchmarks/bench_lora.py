"""Time the `gather`, `indexed` and `grouped` multi-adapter LoRA kernels against the bare base projection; prints JSON.

One projection `x [B, T, D] @ W [D, O]` plus the adapter delta of each row's slot, for a training
batch (8 rows x 256 tokens) and a decode batch (32 rows x 1 token), with 1, 4 or 16 adapters active
out of `--slots` stacked slots, at ranks 1, 8 and 32. Each line is one case: milliseconds per call
(best of `--reps`), the overhead over the base matmul, and the ideal overhead `R (D + O) / (D O)` that the
adapter's FLOPs alone would cost. The last line summarises which kernel is faster per workload.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx.lora.kernels import Kernel, lora_delta
from tx.lora.params import LoRARows

WORKLOADS = {"train": (8, 256), "decode": (32, 1)}
KERNELS: tuple[Kernel, ...] = ("gather", "indexed", "grouped")


def timed(fn: Callable[[], jax.Array], reps: int) -> float:
    """Fastest of `reps` calls in milliseconds, after a warm-up call that also compiles.

    The minimum rather than the median: on a shared machine other processes only ever add time.
    """
    fn().block_until_ready()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn().block_until_ready()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def make_inputs(B: int, T: int, D: int, O: int, S: int, R: int, dtype: jnp.dtype) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 4)
    return {
        "x": jax.random.normal(keys[0], (B, T, D), dtype),
        "w": (jax.random.normal(keys[1], (D, O), jnp.float32) / np.sqrt(D)).astype(dtype),
        "a": jax.random.normal(keys[2], (S, D, R), jnp.float32) / np.sqrt(D),
        "b": jax.random.normal(keys[3], (S, R, O), jnp.float32) * 0.01,
    }


def rows_for(B: int, S: int, R: int, active: int) -> LoRARows:
    # Rows cycle through slots 1..active; every allocated slot gets scale alpha / rank = 32 / R.
    slot = (np.arange(B) % active + 1).astype(np.int32)
    return LoRARows(jnp.asarray(slot), jnp.full((S, R), 32.0 / R, jnp.float32))


def measure(workload: str, D: int, O: int, S: int, ranks: list[int], actives: list[int], reps: int, dtype: Any) -> list:
    B, T = WORKLOADS[workload]
    base_fn = jax.jit(lambda x, w: x @ w)
    inputs = make_inputs(B, T, D, O, S, max(ranks), dtype)
    base_ms = timed(lambda: base_fn(inputs["x"], inputs["w"]), reps)
    records: list[dict[str, Any]] = []
    for R in ranks:
        inp = make_inputs(B, T, D, O, S, R, dtype)
        for kernel in KERNELS:
            fn = jax.jit(lambda x, w, rows, a, b, k=kernel: x @ w + lora_delta(x, rows, a, b, k))
            for active in actives:
                rows = rows_for(B, S, R, active)
                ms = timed(functools.partial(fn, inp["x"], inp["w"], rows, inp["a"], inp["b"]), reps)
                records.append(
                    {
                        "workload": workload,
                        "kernel": kernel,
                        "rank": R,
                        "active": active,
                        "slots": S,
                        "ms": round(ms, 3),
                        "ideal_overhead": round(R * (D + O) / (D * O), 4),
                    }
                )
    # Time the base again after the grid so a burst of load at the start cannot inflate it.
    base_ms = min(base_ms, timed(lambda: base_fn(inputs["x"], inputs["w"]), reps))
    for record in records:
        record["overhead"] = round(record["ms"] / base_ms - 1, 3)
    return [{"workload": workload, "kernel": "base", "B": B, "T": T, "ms": round(base_ms, 3)}, *records]


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each kernel's geometric-mean time over the rank/active grid, and the winner."""
    summary: dict[str, Any] = {}
    for workload in WORKLOADS:
        means = {}
        for kernel in KERNELS:
            times = [r["ms"] for r in records if r["workload"] == workload and r["kernel"] == kernel]
            if times:
                means[kernel] = round(float(np.exp(np.mean(np.log(times)))), 3)
        if means:
            summary[workload] = {"geomean_ms": means, "winner": min(means, key=means.__getitem__)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="CI smoke size: one rank, one mix, small shapes")
    parser.add_argument("--embed", type=int, default=1024, help="D, the projection's input width")
    parser.add_argument("--out", type=int, default=3072, help="O, the projection's output width")
    parser.add_argument("--slots", type=int, default=17, help="S, stacked slots including the base slot 0")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on accelerators)")
    args = parser.parse_args()
    ranks, actives, reps, D, O = [1, 8, 32], [1, 4, 16], args.reps, args.embed, args.out
    if args.quick:
        ranks, actives, reps, D, O = [8], [4], 5, 256, 512
        WORKLOADS["train"] = (4, 64)
    records = []
    for workload in WORKLOADS:
        for record in measure(workload, D, O, args.slots, ranks, actives, reps, jnp.dtype(args.dtype)):
            print(json.dumps(record), flush=True)
            records.append(record)
    device = jax.devices()[0]
    print(json.dumps({"summary": summarise(records), "device": device.device_kind, "D": D, "O": O}))


if __name__ == "__main__":
    main()
