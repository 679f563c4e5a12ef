"""Every backend-specific choice in one table, keyed by `jax.default_backend()`, and passed in from there.

A choice enters `CPU` only with a measurement behind it (the numbers are in the comments below, all from
XLA:CPU on 2 cores); every other backend takes `PLAIN`, the straightforward form of each piece, until a
measurement on that backend says otherwise. `for_backend()` is the one place that asks JAX which backend
runs: the engine calls it at start-up and hands the result to the model (`load_model(tuning=...)`), the
sampler (`SamplerConfig.layer_cache`) and `decode_layout`; modules never ask for themselves.

A choice whose best value differs between CPUs of the same backend is measured on the machine at hand
instead: `tuned_for` times it for the model being loaded, once per machine and model width (the answer is
kept in the server's data directory), and the table's value is only the fallback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx.lora.kernels import Kernel


@dataclasses.dataclass(frozen=True)
class Tuning:
    """backend: the name this tuning was chosen for.
    auto_dtype: what `--dtype auto` means (compute and weight dtype).
    weight_major_rows: decode batches of 2..this many one-token rows multiply `weight @ x.T` behind an
        optimization barrier (`tx.lora.layers.linear`); 0 = always the plain `x @ weight.T`.
    per_layer_decode: the sampler reads its own copy of the decoder weights split into one buffer per
        layer (`decode_layout`, +1x the base weights in memory) and keeps its decode cache per layer
        between chunks (`LayerCache`); False = it reads the trainer's stacked weights (no second copy) and
        keeps the stacked `KVCache`.
    lora_kernel: the multi-adapter product form (`tx.lora.kernels`).
    train_compiler_options: XLA options for the training programs (`tx.engine.compiles.train_jit`).
    moe_dense_max_experts: a mixture-of-experts block of at most this many experts runs every expert on
        every token (`tx.models.moe.dense_experts`); above it, or at 0, the sort-by-expert ragged product.
    moe_block_rows: a call whose pairs fit in fewer padded blocks of this many rows than `dense` computes
        runs the blocked product instead (`tx.models.moe.blocked_experts`), in blocks of at most this many
        rows sized to the call (`SparseMoeBlock.form_for`), and a call of at most X pairs (a decode step)
        runs each pair on its own (`pair_experts`: only the chosen experts read); 0 = neither.
    measure_weight_major: `weight_major_rows` is measured on the machine for each model (`tuned_for`);
        the table's value is what a model built without that measurement gets.
    """

    backend: str
    auto_dtype: str
    weight_major_rows: int
    per_layer_decode: bool
    lora_kernel: Kernel
    train_compiler_options: tuple[tuple[str, Any], ...] = ()
    moe_dense_max_experts: int = 0
    moe_block_rows: int = 0
    measure_weight_major: bool = False

    def compiler_options(self) -> dict[str, Any]:
        return dict(self.train_compiler_options)


# The plain form of every piece: what an accelerator runs until it is measured there.
PLAIN = Tuning("plain", auto_dtype="bfloat16", weight_major_rows=0, per_layer_decode=False, lora_kernel="indexed")

CPU = Tuning(
    "cpu",
    # XLA:CPU has no bfloat16 arithmetic: it is emulated, several times slower than float32.
    auto_dtype="float32",
    # The matmul library streams an [O, I] weight at ~20-25 GB/s as weight @ x.T against ~9-14 GB/s as
    # x @ weight.T at 4-16 rows (30 GB/s at one row either way). Decode step, Qwen3-0.6B shape: batch 4
    # 249 -> 131 ms, batch 8 262 -> 164 ms, batch 16 306 -> 234 ms; `small`: batch 4 5.2 -> 3.8 ms, batch 8
    # 7.5 -> 6.4 ms. At 32 rows `small` measured 4% slower there, hence this fallback; on a Zen 5 EPYC it
    # won up to 64 rows (20-30% at 32), so the engine measures the cap per machine (`tuned_for`).
    weight_major_rows=16,
    measure_weight_major=True,
    # XLA:CPU copies a dynamic slice of a stacked weight before a library matmul, doubling a decode step's
    # weight reads (small, batch 8: 4.5 vs 2.2 ms for the layer matmuls); the per-layer cache layout made
    # decode attention 1.7x faster, and converting the cache per chunk cost 12% of a batch-32 step.
    per_layer_decode=True,
    # The indexed form's backward is a scatter-add, which XLA:CPU runs element by element: +20-30% over
    # the base matmul per projection, against ~0% for the one-hot gather.
    lora_kernel="gather",
    # Compile time is most of a first step on CPU: without the fusion emitters the LoRA gradient program of
    # `small` compiles in 1.7 instead of 2.2 s, LLVM -O1 saves 0.2-0.4 s more; steady steps within 2%.
    train_compiler_options=(("xla_cpu_use_fusion_emitters", False), ("xla_backend_optimization_level", 1)),
    # XLA:CPU has no native ragged dot: it runs one masked product per expert over all N*k sorted rows, so
    # `ragged` costs k times `dense` (every expert on every token). bench_moe.py, D=512, F=384, k=2, fp32
    # matmul peak 89 GFLOP/s: training step on 2048 tokens dense vs ragged 0.90 vs 1.20 s at X=4, 1.74 vs
    # 2.28 s at 8, 3.79 vs 4.93 s at 16; decode of 32 tokens 3.2 vs 6.1 ms at 4, 54 vs 180 ms at 32. At
    # X=128 (one repetition) decode still favoured dense (361 vs 566 ms), prefill ragged (13.2 vs 17.7 s).
    moe_dense_max_experts=32,
    # The blocked product pays at most X * (rows - 1) padding rows over the active ones, so it runs where
    # they are fewer than dense's N * X rows. Blocks of 128 rows: training step of one block of 2048 tokens
    # (8 experts 512 x 768, top-2) 137 ms vs 158 (64), 155 (256), 170 (512). Decode, 8 layers of that block,
    # blocks about two per expert (`form_for`) against dense, per layer: 1 token 0.55 vs 4.7 ms, 16 tokens
    # 2.4 vs 5.9 ms, 64 tokens 3.2 vs 8.8 ms (dense's einsum of a few rows runs far below bandwidth). At most
    # X pairs, each on its own (`pairs`): 1 token 0.30 vs 0.55 ms (one-row blocks; 0.24 ms reads the two
    # experts at 40 GB/s), 2 tokens 0.56 vs 0.96, 4 tokens 0.75 vs 1.26 (the best block height).
    moe_block_rows=128,
)

TUNINGS: dict[str, Tuning] = {"cpu": CPU}


def moe_forms(tuning: Tuning) -> Tuning:
    """`PLAIN` with `tuning`'s mixture-of-experts product forms: what the hybrid Qwen3.5 family takes from a
    backend's tuning. The product forms are chosen per MoE block, whatever layers surround it; the family's
    other products stay plain (its weight-major decode measured slower, `benchmarks/RESULTS.md`)."""
    return dataclasses.replace(
        PLAIN, moe_dense_max_experts=tuning.moe_dense_max_experts, moe_block_rows=tuning.moe_block_rows
    )


def for_backend(backend: str | None = None) -> Tuning:
    """The tuning of `backend` (default: the backend JAX runs on); `PLAIN` under its name when unmeasured."""
    name = backend or jax.default_backend()
    return TUNINGS.get(name) or dataclasses.replace(PLAIN, backend=name)


# ---- choices measured on the machine ---------------------------------------------------------------------

WEIGHT_MAJOR_CANDIDATES = (2, 4, 8, 16, 32, 64, 128, 256)  # decode batch sizes tried, ascending
_MEASURED: dict[str, int] = {}  # this process's answers by probe key
log = logging.getLogger("tx.tuning")


def tuned_for(
    tuning: Tuning, hidden: int, intermediate: int, dtype: str, max_rows: int, store: Path | None = None
) -> Tuning:
    """`tuning` with the choices it leaves to measurement made for a model of this width and dtype on this
    machine: `weight_major_rows`, the decode batch (of at most `max_rows` rows) up to which `weight @ x.T`
    beats `x @ weight.T`. Answers are kept per process and, given `store` (a JSON file), across restarts,
    keyed by CPU, thread count, JAX version, dtype, width and `max_rows`. Several processes of one program
    (multi-host) keep the table's value: each measuring on its own could compile different programs."""
    if not tuning.measure_weight_major or jax.process_count() > 1:
        return tuning
    key = probe_key(hidden, intermediate, dtype, max_rows)
    rows = _MEASURED.get(key)
    if rows is None:
        rows = _read_store(store).get(key)
    if rows is None:
        start = time.perf_counter()
        rows = measure_weight_major_rows(hidden, intermediate, dtype, max_rows, tuning.compiler_options())
        log.info("decode products weight-major up to %d rows (measured in %.2f s)", rows, time.perf_counter() - start)
        _write_store(store, key, rows)
    _MEASURED[key] = rows
    return dataclasses.replace(tuning, weight_major_rows=rows, measure_weight_major=False)


def probe_key(hidden: int, intermediate: int, dtype: str, max_rows: int) -> str:
    """What a measured answer depends on: the CPU, the threads this process may use, JAX, the model."""
    return f"{_machine()}|jax {jax.__version__}|{dtype}|{hidden}x{intermediate}|rows<={max_rows}"


def measure_weight_major_rows(
    hidden: int, intermediate: int, dtype: str, max_rows: int = WEIGHT_MAJOR_CANDIDATES[-1], options: dict | None = None
) -> int:
    """Times both decode products (`tx.lora.layers.linear`) as a decode step runs them, at growing batch
    sizes up to `max_rows` until the weight-major one stops winning -> `choose_weight_major_rows`.
    `options`: XLA compiler options for the timed programs."""
    layers = probe_layers(hidden, intermediate, dtype)

    def array(*shape: int) -> jax.Array:  # from the host: an eager jnp.ones would compile per shape
        return jax.device_put(np.full(shape, 0.01, jnp.dtype(dtype)))

    weights = tuple((array(layers.width, hidden), array(hidden, layers.width)) for _ in range(layers.count))
    timings: dict[int, tuple[float, float]] = {}
    for rows in (n for n in WEIGHT_MAJOR_CANDIDATES if n <= max_rows):
        xs = (array(rows, hidden), array(rows, layers.width))
        plain, major = timings[rows] = _race(xs, weights, options or {})
        if major >= plain:
            break
    return choose_weight_major_rows(timings)


@dataclasses.dataclass(frozen=True)
class ProbeLayers:
    count: int  # MLP weight pairs ([width, hidden] and [hidden, width]) one timed call multiplies by
    width: int  # their intermediate width: the model's, cut so that a pair is at most half of PROBE_BYTES


PROBE_BYTES = 64 << 20  # weights one timed call streams: more than a CPU's caches hold, as a decode step reads
MAX_PROBE_LAYERS = 32  # a tiny model's pairs: its whole decode step stays in cache anyway


def probe_layers(hidden: int, intermediate: int, dtype: str) -> ProbeLayers:
    """The layers a probe call multiplies by: like a decode step, each weight once, enough of them that
    they come from memory rather than cache (a weight reused call after call would stay in cache)."""
    itemsize = jnp.dtype(dtype).itemsize
    width = max(1, min(intermediate, PROBE_BYTES // (4 * hidden * itemsize)))
    count = -(-PROBE_BYTES // (2 * hidden * width * itemsize))
    return ProbeLayers(max(1, min(MAX_PROBE_LAYERS, count)), width)


def choose_weight_major_rows(timings: Mapping[int, tuple[float, float]]) -> int:
    """{batch: (plain seconds, weight-major seconds)} -> the largest batch below the first one where the
    weight-major product does not win (0: it loses at the smallest)."""
    rows = 0
    for batch in sorted(timings):
        plain, major = timings[batch]
        if major >= plain:
            break
        rows = batch
    return rows


Pair = tuple[jax.Array, jax.Array]


@jax.jit
def _plain_products(xs: Pair, weights: tuple[Pair, ...]) -> list[Pair]:
    """x [B, D] by each [F, D] weight and x' [B, F] by each [D, F] weight, `x @ weight.T`."""
    return [(xs[0] @ up.T, xs[1] @ down.T) for up, down in weights]


@jax.jit
def _weight_major_products(xs: Pair, weights: tuple[Pair, ...]) -> list[Pair]:
    """The same products as `weight @ x.T`, transposed behind a barrier (as `tx.lora.layers.linear`)."""
    out = jax.lax.optimization_barrier([(up @ xs[0].T, down @ xs[1].T) for up, down in weights])
    return [(a.T, b.T) for a, b in out]


def _race(xs: Pair, weights: tuple[Pair, ...], options: dict[str, Any], rounds: int = 3) -> tuple[float, float]:
    """(plain, weight-major) seconds a call: the best of `rounds` alternating bursts (about 2 ms each) of
    each form, after one call of each that sizes the bursts. Compiled with `options` (CPU: without XLA's
    fusion emitters, which took 80 of the 85 ms a weight-major program compiled in)."""
    forms = [form.lower(xs, weights).compile(options) for form in (_plain_products, _weight_major_products)]
    calls = []
    for products in forms:
        jax.block_until_ready(products(xs, weights))
        start = time.perf_counter()
        jax.block_until_ready(products(xs, weights))
        calls.append(max(1, min(50, int(2e-3 / max(time.perf_counter() - start, 1e-6)))))
    best = [float("inf")] * 2
    for _ in range(rounds):
        for i, products in enumerate(forms):
            start = time.perf_counter()
            for _ in range(calls[i]):
                out = products(xs, weights)
            jax.block_until_ready(out)
            best[i] = min(best[i], (time.perf_counter() - start) / calls[i])
    return best[0], best[1]


def _machine() -> str:
    """The CPU's model name and the threads this process may use: what the measured answers depend on."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} x{threads}"


def _read_store(store: Path | None) -> dict[str, int]:
    """The stored answers; a missing, unreadable or malformed file (or entry) reads as nothing stored."""
    if store is None:
        return {}
    try:
        data = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    valid = (0, *WEIGHT_MAJOR_CANDIDATES)
    return {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v in valid}


def _write_store(store: Path | None, key: str, rows: int) -> None:
    if store is None:
        return
    answers = {**_read_store(store), key: rows}
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        partial = store.with_name(f"{store.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(answers, indent=1, sort_keys=True))
        os.replace(partial, store)  # whole files only: a concurrent reader sees the old answers or the new
    except OSError as err:  # a read-only data directory: measure again next start
        log.warning("could not keep the measured tuning in %s: %s", store, err)
