"""Training throughput: tokens/s of forward_backward + optim_step, and first-step compile seconds.

Runs the engine's Trainer in-process on a random-weight model (no server, no files) for LoRA ranks and
full fine-tuning, with the backend's tuning (`tx.tuning`), prints one JSON line per mode as it finishes and
one JSON document at the end. `compile_s` is the first step's time minus a steady step's; FLOPs count
the base weights a token multiplies by (6 per weight for full fine-tuning, 4 for LoRA: no weight
gradient; a MoE model's routed experts at top_k / experts, its active FLOPs), reported as a fraction of
the float32 matmul peak measured in the same run. `--vs-transformers` times transformers' CPU
implementation of the same shape and modes in the same run (`vs_transformers.train_point`). Example:
    python benchmarks/train_throughput.py --shape small --batch 8 --length 256
    python benchmarks/train_throughput.py --shape qwen3-0.6b --dtype bfloat16 --batch 16 --length 1024
    python benchmarks/train_throughput.py --shape qwen3.5-small --modes r8,full   # the hybrid family
    python benchmarks/train_throughput.py --shape gpt-oss-small --modes r8,full --vs-transformers
    python benchmarks/train_throughput.py --quick          # CI smoke: tiny shape, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import matmul_peak  # noqa: E402
from shapes import SHAPES, active_param_count, model_config, peak_memory, random_model  # noqa: E402

from tx.engine.bank import AdapterBank  # noqa: E402
from tx.engine.trainer import Trainer  # noqa: E402
from tx.lora.layers import LoRASpec  # noqa: E402
from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, LoraConfig  # noqa: E402
from tx.tuning import for_backend  # noqa: E402


def workload(vocab: int, batch: int, length: int, seed: int = 0) -> ForwardBackwardRequest:
    rng = np.random.RandomState(seed)
    data = []
    for _ in range(batch):
        tokens = rng.randint(0, vocab, length + 1)
        data.append(Datum(tokens[:-1].tolist(), {"target_tokens": tokens[1:].astype(np.int64)}))
    return ForwardBackwardRequest(data, "cross_entropy")


def measure(shape: str, mode: str, batch: int, length: int, steps: int, max_rank: int, dtype: str) -> dict:
    rank = None if mode == "full" else int(mode.split("r")[1])
    spec = LoRASpec(slots=2, max_rank=max(max_rank, rank or 1), kernel=for_backend().lora_kernel)
    model = random_model(shape, spec, dtype)
    trainer = Trainer(model, AdapterBank.of(model), micro_batch_tokens=max(batch * length, 2048))
    if rank is None:
        trainer.create_full_run("run")
    else:
        trainer.create_lora_run("run", LoraConfig(rank=rank), slot=1)
    req = workload(model.config.vocab_size, batch, length)
    adam = AdamParams(learning_rate=1e-5)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        trainer.forward_backward([("run", req)])
        trainer.optim_step("run", adam)
        jax.block_until_ready((trainer.bank.arrays, trainer.runs["run"].params))
        times.append(time.perf_counter() - start)
    steady = statistics.median(times[1:])
    tokens = batch * length
    cfg = model_config(shape)
    flops = (6 if rank is None else 4) * active_param_count(cfg) * tokens
    return {
        "shape": shape,
        "mode": mode,
        "dtype": dtype,
        "batch": batch,
        "length": length,
        "tokens_per_step": tokens,
        "first_step_s": round(times[0], 3),
        "compile_s": round(max(times[0] - steady, 0.0), 3),
        "steady_step_s": round(steady, 4),
        "tokens_per_s": round(tokens / steady, 1),
        "gflops_per_s": round(flops / steady / 1e9, 1),
        **peak_memory(),
    }


def add_transformers(row: dict, args: argparse.Namespace, peak: float) -> None:
    """transformers' tokens/s and fraction of peak for the row's shape and mode, and our speed-up over it."""
    from vs_transformers import train_point

    theirs = train_point(row["shape"], row["mode"], args.batch, args.length, args.steps, peak)
    row["transformers_tokens_per_s"] = theirs["tokens_per_s"]
    row["transformers_gflops_per_s"] = theirs["gflops_per_s"]
    row["speedup_vs_transformers"] = round(row["tokens_per_s"] / theirs["tokens_per_s"], 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--dtype", default="float32", help="weights and compute (LoRA masters stay float32)")
    p.add_argument("--modes", default="r8,r32,full", help="comma list of rN (LoRA rank N) and full")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="steady-state steps after the first (median reported)")
    p.add_argument("--quick", action="store_true", help="tiny shape, batch 2 x 32, 1 step: a smoke test")
    p.add_argument("--vs-transformers", action="store_true", help="also transformers' CPU model, same modes")
    args = p.parse_args()
    if args.quick:
        args.shape, args.batch, args.length, args.steps, args.modes = "tiny", 2, 32, 1, "r8,full"
    modes = args.modes.split(",")
    max_rank = max([int(m[1:]) for m in modes if m.startswith("r")] or [1])
    size = 256 if args.quick else None
    before = matmul_peak(size, dtype=args.dtype)  # the peak of the dtype the model computes in
    results = []
    for mode in modes:
        results.append(measure(args.shape, mode, args.batch, args.length, args.steps, max_rank, args.dtype))
        if args.vs_transformers:
            add_transformers(results[-1], args, before)
    # The peak again after the runs, and the higher of the two counts: on a shared host one measurement can
    # land in a slow second and flatter every fraction (the same step read 0.33 and 0.72 of two peaks).
    after = matmul_peak(size, dtype=args.dtype)
    peak = max(before, after)
    for row in results:
        row["fraction_of_peak"] = round(row["gflops_per_s"] / peak, 3)
        if "transformers_gflops_per_s" in row:
            row["transformers_fraction_of_peak"] = round(row["transformers_gflops_per_s"] / peak, 3)
        print(json.dumps(row), flush=True)
    out = {
        "benchmark": "train_throughput",
        ("fp32_matmul_peak_gflops_per_s" if args.dtype == "float32" else "matmul_peak_gflops_per_s"): round(peak, 1),
        "matmul_peak_samples_gflops_per_s": [round(before, 1), round(after, 1)],
        "matmul_peak_dtype": args.dtype,
        "backend": jax.default_backend(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "devices": jax.local_device_count(),
        "results": results,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
