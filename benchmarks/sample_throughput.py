"""Sampling throughput of `tx.engine.sampler.Sampler` on a random-weight model: generated tokens per second.

For each batch size B, B independent requests (prompt P random tokens, T new tokens, temperature 1, no
early stop) are submitted at once and stepped until done; prefill is included, as in HF `generate`. The
first run of a shape pays its compiles; `compile_s` is that run's wall time minus the steady run's.
Variants: `base` (a model without adapters) and `lora` (the server's 9 slots of max rank 32, every row on
a rank-8 adapter in slot 1).

    python benchmarks/sample_throughput.py                 # small shape, B = 1, 8, 32
    python benchmarks/sample_throughput.py --full          # ... and B = 128
    python benchmarks/sample_throughput.py --qwen3-0.6b    # the Qwen3-0.6B shape (fp32)
    python benchmarks/sample_throughput.py --quick         # CI smoke, well under 20 s
    python benchmarks/sample_throughput.py --shapes qwen3-moe-small gpt-oss-small --vs-transformers
    python benchmarks/sample_throughput.py --shapes qwen3-0.6b --dtype bfloat16 --batches 1 64 256 1024 \
        --variants lora --repeats 1                        # GPU sizes (benchmarks/device_check.sh)

The sampler gets the backend's tuning (`tx.tuning`): on CPU the per-layer weight copy and cache, elsewhere
the stacked weights and cache. All of a batch's prompts are admitted in one step (one prefill). Prints one
JSON line per point as it finishes and one JSON document at the end (also written to --out when given).
A MoE shape's decode ceiling counts the weights a token reads on average (its picked experts' share).
`--vs-transformers`: transformers' batch-1 `generate` of the same shape (greedy, prefill included) timed
in the same run, next to each shape's batch-1 points.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tx.engine.build import machine_tuning
from tx.engine.sampler import Sampler, SamplerConfig
from tx.engine.train_step import flat
from tx.lora.layers import LoRASpec
from tx.lora.params import AdapterRoles, slot_scale
from tx.models.causal_lm import decode_layout
from tx.models.config import ModelConfig
from tx.protocol import SampleRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import read_bandwidth  # noqa: E402
from shapes import SHAPES, active_param_count, model_config, peak_memory, random_state  # noqa: E402

LORA_RANK = 8
LORA_SLOTS, MAX_RANK = 9, 32  # the server defaults (--max-lora-adapters 8, --max-lora-rank 32)


class FixedAdapters:
    """The sampler's view of an adapter bank that never changes (unversioned: no prompt cache, so every
    round prefills, as a fresh prompt does)."""

    def __init__(self, scale: np.ndarray, roles: AdapterRoles) -> None:
        self.scale, self.roles = scale, roles

    def weights_version(self) -> None:
        return None


def make_sampler(cfg: ModelConfig, lora: bool, max_rows: int, max_seq_len: int, max_prompt: int) -> Sampler:
    """`lora`: the server's default stack (8 adapter slots + the zero slot, max rank 32) holding one
    rank-8 adapter in slot 1. Weights, cache form and kernel as the engine lays them out on this backend."""
    tuning = machine_tuning(cfg, max_rows)
    spec = LoRASpec(slots=LORA_SLOTS, max_rank=MAX_RANK, kernel=tuning.lora_kernel) if lora else None
    graphdef, state = random_state(cfg, spec, tuning=tuning)
    scale = np.zeros((LORA_SLOTS, MAX_RANK), np.float32)
    scale[1] = np.asarray(slot_scale(LORA_RANK, 32.0, MAX_RANK))
    sampler_cfg = SamplerConfig(
        max_rows=max_rows,
        max_seq_len=max_seq_len,
        chunk_steps=16,
        max_prefill_tokens=max(max_rows * max_prompt, 8192),
        layer_cache=tuning.per_layer_decode,
    )
    roles = AdapterRoles.of(state)
    weights = decode_layout(flat(state), tuning, adapters=roles)
    adapters = FixedAdapters(scale, roles) if lora else None
    return Sampler(graphdef, lambda: weights, cfg, sampler_cfg, [], lambda ids: "", adapters)


def run_batch(sampler: Sampler, batch: int, prompt_len: int, new_tokens: int, vocab: int, slot: int) -> float:
    """Wall seconds to sample `batch` requests to completion."""
    rng = np.random.default_rng(batch)
    start = time.perf_counter()
    for i in range(batch):
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, stop_at_eos=False)
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        sampler.submit(f"r{i}", SampleRequest(prompt, 1, params, "bench"), slot)
    done = 0
    while not sampler.idle():
        done += len(sampler.step())
    assert done == batch
    return time.perf_counter() - start


def measure(args: argparse.Namespace, shape: str, batches: list[int], variants: list[str]) -> list[dict[str, Any]]:
    cfg = model_config(shape, args.dtype)
    rows = []
    for variant in variants:
        sampler = make_sampler(cfg, variant == "lora", max(batches), args.prompt + args.new_tokens, args.prompt)
        slot = 1 if variant == "lora" else 0
        for batch in batches:
            compiles = sampler.compile_count
            first = run_batch(sampler, batch, args.prompt, args.new_tokens, cfg.vocab_size, slot)
            compiles = sampler.compile_count - compiles
            steady = statistics.median(
                run_batch(sampler, batch, args.prompt, args.new_tokens, cfg.vocab_size, slot)
                for _ in range(args.repeats)
            )
            row = dict(
                shape=shape,
                variant=variant,
                dtype=args.dtype,
                batch=batch,
                first_s=round(first, 3),
                steady_s=round(steady, 3),
                compile_s=round(max(first - steady, 0.0), 3),
                compiles=compiles,
                tokens_per_s=round(batch * args.new_tokens / steady, 1),
                **rates(cfg, batch, args.prompt, args.new_tokens, steady),
                **peak_memory(),
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def rates(cfg: ModelConfig, batch: int, prompt: int, new: int, seconds: float) -> dict[str, float]:
    """The least work a point needs, as rates over its measured time: `gflops_per_s` (2 per weight per generated
    token, the same less the unembedding per prompt token, 4 * heads * head_dim per attended position in each
    attention layer) and `gb_per_s` (the weights once for the prefill and once per decode step, every step's
    read of its rows' keys and values). Over the machine's matmul peak and read bandwidth they add up to the
    point's fraction of its roofline (above 1 where weights stay in the caches between steps)."""
    params, item = active_param_count(cfg), np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
    attention = len(cfg.layers_holding("self_attn"))
    total = prompt + new
    attended = batch * total * (total + 1) // 2  # causal: token t attends t positions
    matmul = params * new + (params - cfg.vocab_size * cfg.hidden_size) * prompt  # prefill computes no logits
    flops = 2 * batch * matmul + 4 * attention * cfg.num_heads * cfg.head_dim * attended
    kv_position = 2 * attention * cfg.num_kv_heads * cfg.head_dim * item
    read = params * item * (1 + new) + batch * kv_position * sum(prompt + t for t in range(new))
    return {"gflops_per_s": round(flops / seconds / 1e9, 2), "gb_per_s": round(read / seconds / 1e9, 2)}


def weight_bytes(shape: str, dtype: str) -> int:
    """Bytes a batch-1 decode step reads: every weight it multiplies by, and for Gated DeltaNet layers their
    recurrent state (float32, read and written)."""
    cfg = model_config(shape, dtype)
    state = 0
    if cfg.linear is not None:
        lin = cfg.linear
        state = 2 * 4 * len(cfg.layers_holding("linear_attn")) * lin.value_heads * lin.key_head_dim * lin.value_head_dim
    return np.dtype(jax.numpy.dtype(dtype)).itemsize * active_param_count(cfg) + state


def add_ceiling(results: list[dict], bandwidth: float) -> None:
    """Batch-1 points: the decode ceiling (bandwidth / weight bytes per step) and the fraction reached
    (prefill included in the measured rate, so the fraction is a lower bound for decode alone)."""
    for point in results:
        if point["batch"] == 1:
            ceiling = bandwidth / weight_bytes(point["shape"], point["dtype"])
            point["ceiling_tokens_per_s"] = round(ceiling, 1)
            point["fraction_of_ceiling"] = round(point["tokens_per_s"] / ceiling, 3)


def add_transformers(results: list[dict], args: argparse.Namespace) -> None:
    """Each shape's transformers batch-1 generate tokens/s on its batch-1 points, and our speed-up over it."""
    from vs_transformers import generate_tokens_per_s, hf_model

    theirs: dict[str, float] = {}
    for point in results:
        if point["batch"] != 1:
            continue
        shape = point["shape"]
        if shape not in theirs:
            vocab = model_config(shape).vocab_size
            theirs[shape] = generate_tokens_per_s(hf_model(shape), args.prompt, args.new_tokens, vocab)
        point["transformers_tokens_per_s"] = round(theirs[shape], 1)
        point["speedup_vs_transformers"] = round(point["tokens_per_s"] / theirs[shape], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also batch 128")
    parser.add_argument("--quick", action="store_true", help="CI smoke: batch 4, short sequences")
    parser.add_argument("--qwen3-0.6b", dest="qwen", action="store_true", help="also the Qwen3-0.6B shape (fp32)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="these shapes instead (default small)")
    parser.add_argument("--batches", nargs="+", type=int, help="these batch sizes instead")
    parser.add_argument("--variants", nargs="+", choices=["base", "lora"], default=["base", "lora"])
    parser.add_argument("--dtype", default="float32", help="weights, cache and compute (adapters stay float32)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="steady runs per point (median)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--vs-transformers", action="store_true", help="also transformers' batch-1 generate")
    args = parser.parse_args()
    batches = args.batches or [1, 8, 32] + ([128] if args.full else [])
    if args.quick:
        batches, args.prompt, args.new_tokens, args.repeats = [4], 32, 16, 1
    shapes = args.shapes or ["small"] + (["qwen3-0.6b"] if args.qwen else [])
    results = [row for shape in shapes for row in measure(args, shape, batches, args.variants)]
    bandwidth = read_bandwidth(64 if args.quick else None)
    add_ceiling(results, bandwidth)
    if args.vs_transformers:
        add_transformers(results, args)
    doc = dict(
        benchmark="sample_throughput",
        read_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        prompt_tokens=args.prompt,
        new_tokens=args.new_tokens,
        chunk_steps=16,
        lora_rank=LORA_RANK,
        lora_slots=LORA_SLOTS,
        max_lora_rank=MAX_RANK,
        jax=jax.__version__,
        backend=jax.default_backend(),
        machine=platform.machine(),
        results=results,
    )
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
