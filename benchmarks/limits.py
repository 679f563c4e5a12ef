"""The machine's own limits, measured in the run that reports against them: the matmul peak (float32 unless
a benchmark computes in another dtype) and the stream-read bandwidth. Machines differ from session to session
(AVX2 or AVX-512, other load), so a throughput means something only next to these. As a script it prints
both as one JSON object (`run_all.py` measures them so in its own run):

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


def on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def matmul_peak(size: int | None = None, reps: int = 5, dtype: str = "float32") -> float:
    """GFLOP/s of the best [size, size] x [size, size] matmul in `dtype` (float32 at full precision: a GPU
    would round it to TF32). The default size is 2048 on a CPU and 8192 on an accelerator, where a 2048
    product is too short to reach the peak."""
    size = size or (8192 if on_accelerator() else 2048)
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    product = jax.jit(lambda a: jnp.matmul(a, a, precision=jax.lax.Precision.HIGHEST))
    return 2 * size**3 / timed(lambda: product(a), reps) / 1e6


def read_bandwidth(megabytes: int | None = None, repeats: int = 5) -> float:
    """Stream-read bandwidth in bytes/s: a jitted sum over a `megabytes` fp32 array (far larger than the
    caches), using every core as XLA does; the median of `repeats` runs after a warm-up. The default is 512 MB
    on a CPU and 4 GB on an accelerator (whose reads of 512 MB take a fraction of a millisecond)."""
    megabytes = megabytes or (4096 if on_accelerator() else 512)
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
    peak, bandwidth = matmul_peak(256 if args.quick else None), read_bandwidth(64 if args.quick else None)
    limits = {"fp32_matmul_peak_gflops_per_s": round(peak, 1), "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    print(json.dumps({"benchmark": "limits", **limits, "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
