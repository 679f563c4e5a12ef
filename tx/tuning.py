"""Every backend-specific choice in one table, keyed by `jax.default_backend()`, and passed in from there.

A choice enters `CPU` only with a measurement behind it (the numbers are in the comments below, all from
XLA:CPU on 2 cores); every other backend takes `PLAIN`, the straightforward form of each piece, until a
measurement on that backend says otherwise. `for_backend()` is the one place that asks JAX which backend
runs: the engine calls it at start-up and hands the result to the model (`load_model(tuning=...)`), the
sampler (`SamplerConfig.layer_cache`) and `decode_layout`; modules never ask for themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

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
        runs the blocked product instead (`tx.models.moe.blocked_experts`), and a call of at most X/2 pairs
        runs it with one-row blocks (reads only the chosen experts); 0 = never.
    """

    backend: str
    auto_dtype: str
    weight_major_rows: int
    per_layer_decode: bool
    lora_kernel: Kernel
    train_compiler_options: tuple[tuple[str, Any], ...] = ()
    moe_dense_max_experts: int = 0
    moe_block_rows: int = 0

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
    # 7.5 -> 6.4 ms. At 32 rows `small` measured 4% slower, hence the cap.
    weight_major_rows=16,
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
    # The blocked product pays at most X * 127 padding rows over the active ones, so it runs where the tokens
    # outnumber the experts' padding (training, prefill); decode of at most X/2 pairs gathers the chosen
    # experts (one-row blocks: 0.8 vs 6.8 ms for one token on 8 experts 512 x 768), larger decode stays dense.
    moe_block_rows=128,
)

TUNINGS: dict[str, Tuning] = {"cpu": CPU}


def for_backend(backend: str | None = None) -> Tuning:
    """The tuning of `backend` (default: the backend JAX runs on); `PLAIN` under its name when unmeasured."""
    name = backend or jax.default_backend()
    return TUNINGS.get(name) or dataclasses.replace(PLAIN, backend=name)
