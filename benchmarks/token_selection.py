"""What choosing the next token costs a decode step, by the rows' filters (JSON output).

`tx.engine.sampling.select_tokens` alone, jitted, on random logits [B, V] (V = 151936 by default, Qwen3's
vocabulary), for four mixes of rows: none filtering (greedy-free sampling), every row with a top-k inside the
candidate cap (`top_k=20`), one row whose top-p nucleus passes the candidates' mass (`top_p=0.95` over flat
logits) beside unfiltered rows, and every row so. The last two are the rows the candidates do not cover:
each finds its own thresholds, so their cost grows with their number, not with the batch. Minimum of
`--repeats` calls after a compile, milliseconds.

    python benchmarks/token_selection.py                      # B = 1, 8, 64 over 151936 tokens
    python benchmarks/token_selection.py --batch 8 --vocab 8192 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp

from tx.engine.sampling import row_keys, select_tokens


def _ms(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return round(min(times), 2)


def _mixes(B: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """name -> (top_k [B], top_p [B])."""
    off_k, off_p = jnp.full(B, -1, jnp.int32), jnp.ones(B, jnp.float32)
    return {
        "unfiltered": (off_k, off_p),
        "top_k_20": (jnp.full(B, 20, jnp.int32), off_p),
        "one_wide_nucleus": (off_k, off_p.at[0].set(0.95)),
        "every_row_wide_nucleus": (off_k, jnp.full(B, 0.95, jnp.float32)),
    }


def batch_point(B: int, V: int, repeats: int) -> dict[str, Any]:
    select = jax.jit(select_tokens)
    logits = jax.random.normal(jax.random.key(1), (B, V)) * 2.0
    keys = row_keys(jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32))
    temperature = jnp.ones(B, jnp.float32)
    ms = {name: _ms(select, (logits, keys, temperature, k, p), repeats) for name, (k, p) in _mixes(B).items()}
    return {"batch": B, "vocab": V, "ms": ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    report = {
        "benchmark": "token_selection",
        "machine": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "results": [batch_point(B, args.vocab, args.repeats) for B in args.batch],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
