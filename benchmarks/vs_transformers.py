"""transformers' CPU implementation of a benchmark shape, timed in the same run as the machine's limits:
a training step (forward, backward, AdamW; full fine-tuning, or a LoRA via peft) and batch-1 generation.
Put its numbers next to `train_throughput.py` / `sample_throughput.py` on the same shape. Example:
    python benchmarks/vs_transformers.py --shape qwen3.5-small
    python benchmarks/vs_transformers.py --quick            # CI smoke: tiny shape, short runs
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import matmul_peak, read_bandwidth  # noqa: E402
from shapes import SHAPES, model_config, param_count  # noqa: E402


def hf_model(shape: str) -> torch.nn.Module:
    """The shape as a random-weight transformers model (float32, eval mode for generation)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6)
    if shape.startswith("qwen3.5"):
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        config = Qwen3_5TextConfig(**SHAPES[shape], **common, linear_conv_kernel_dim=4, rope_parameters=rope)
        return Qwen3_5ForCausalLM(config).float()
    return Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], **common)).float()


def train_step_s(model: torch.nn.Module, batch: int, length: int, steps: int, vocab: int) -> float:
    """Median seconds of forward + backward + AdamW on `batch` x `length` tokens (first step excluded)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    tokens = torch.randint(0, vocab, (batch, length + 1))
    model.train()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def generate_tokens_per_s(model: torch.nn.Module, prompt: int, new: int, vocab: int) -> float:
    model.eval()
    tokens = torch.randint(0, vocab, (1, prompt))
    kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        model.generate(tokens, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(tokens, **kwargs)
    return new / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-small", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--modes", default="r8,full", help="comma list of rN (LoRA rank N via peft) and full")
    p.add_argument("--quick", action="store_true", help="tiny shape, 2 x 32 tokens, 8 new tokens")
    args = p.parse_args()
    if args.quick:
        args.shape, args.batch, args.length, args.steps, args.prompt, args.new_tokens = "tiny", 2, 32, 1, 16, 8
    torch.set_num_threads(torch.get_num_threads())  # all cores, as XLA uses them
    cfg = model_config(args.shape)
    n = param_count(cfg)
    peak, bandwidth = matmul_peak(256 if args.quick else 2048), read_bandwidth(64 if args.quick else 512)
    rows = []
    for mode in args.modes.split(","):
        model = hf_model(args.shape)
        if mode != "full":
            from peft import LoraConfig, get_peft_model

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            if args.shape.startswith("qwen3.5"):  # every projection, as SmolGym's train_attn + train_mlp adapt
                targets += ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
            model = get_peft_model(model, LoraConfig(r=int(mode[1:]), lora_alpha=32, target_modules=targets))
        step = train_step_s(model, args.batch, args.length, args.steps, cfg.vocab_size)
        flops = (6 if mode == "full" else 4) * n * args.batch * args.length
        rows.append(dict(shape=args.shape, mode=mode, tokens_per_s=round(args.batch * args.length / step, 1),
                         gflops_per_s=round(flops / step / 1e9, 1),
                         fraction_of_peak=round(flops / step / 1e9 / peak, 3)))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    decode = generate_tokens_per_s(hf_model(args.shape), args.prompt, args.new_tokens, cfg.vocab_size)
    ceiling = bandwidth / (4 * n)
    rows.append(dict(shape=args.shape, mode="generate_batch1", tokens_per_s=round(decode, 1),
                     gb_per_s=round(decode * 4 * n / 1e9, 2),
                     fraction_of_ceiling=round(decode / ceiling, 3)))  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    doc = dict(benchmark="vs_transformers", torch=torch.__version__, threads=torch.get_num_threads(),
               machine=platform.machine(), fp32_matmul_peak_gflops_per_s=round(peak, 1),
               read_bandwidth_gb_s=round(bandwidth / 1e9, 2), results=rows)  # fmt: skip
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
