"""The machine's own limits, measured in the run that reports against them: the float32 matmul peak
and the stream-read bandwidth. Machines differ from session to session (AVX2 or AVX-512, other load),
so a throughput means something only next to these. As a script it prints both as one JSON object
(`run_all.py` measures them so in its own run):

    python benchmarks/limits.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of `reps` calls in milliseconds after a warm-up (compiling) call: other load only adds time."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def matmul_peak(size: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of the best [size, size] x [size, size] float32 matmul."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    product = jax.jit(lambda a: a @ a)
    return 2 * size**3 / timed(lambda: product(a), reps) / 1e6


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Stream-read bandwidth in bytes/s: a jitted sum over a `megabytes` fp32 array (far larger than the
    caches), using every core as XLA does; the median of `repeats` runs after a warm-up."""
    x = jnp.ones((megabytes << 18,), jnp.float32)
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return x.nbytes / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 256 matmul and a 64 MB read (CI smoke)")
    args = p.parse_args()
    peak, bandwidth = matmul_peak(256 if args.quick else 2048), read_bandwidth(64 if args.quick else 512)
    limits = {"fp32_matmul_peak_gflops_per_s": round(peak, 1), "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    print(json.dumps({"benchmark": "limits", **limits, "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
