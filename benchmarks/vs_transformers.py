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
from shapes import COMMON, GPT_OSS_ROPE, SHAPES, active_param_count, model_config  # noqa: E402


def hf_model(shape: str) -> torch.nn.Module:
    """The shape as a random-weight transformers model (float32, eval mode for generation)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(COMMON)
    if shape.startswith("qwen3-moe"):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES[shape], **common, rope_theta=1e6)).float()
    if shape.startswith("gpt-oss"):
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(**SHAPES[shape], **common, rope_parameters=GPT_OSS_ROPE)
        return GptOssForCausalLM(config).float()
    if shape.startswith("qwen3.5"):
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        moe = "num_experts" in SHAPES[shape]
        config_class, model_class = (
            (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
        )
        config = config_class(**SHAPES[shape], **common, linear_conv_kernel_dim=4, rope_parameters=rope)
        return model_class(config).float()
    return Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], **common)).float()


def with_lora(model: torch.nn.Module, shape: str, rank: int) -> torch.nn.Module:
    """A peft LoRA of `rank` on what SmolGym's train_attn + train_mlp adapt: every attention and MLP
    projection, a MoE model's experts (peft retargets Qwen3-MoE's expert names onto its fused experts;
    gpt-oss's and Qwen3.5-MoE's are fused parameters, named as such)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if shape.startswith("qwen3.5"):
        targets += ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
    fused = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    if shape.startswith("gpt-oss"):
        config = LoraConfig(r=rank, lora_alpha=32, target_modules=targets[:4], target_parameters=fused)
        return get_peft_model(model, config)
    if "num_experts" in SHAPES[shape] and shape.startswith("qwen3.5"):  # fused experts; the shared expert's modules
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets, target_parameters=fused))
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets))


def train_point(shape: str, mode: str, batch: int, length: int, steps: int, peak: float) -> dict[str, Any]:
    """transformers' training tokens/s of `mode` (rN or full) and its fraction of `peak` on active FLOPs."""
    model = hf_model(shape)
    if mode != "full":
        model = with_lora(model, shape, int(mode[1:]))
    step = train_step_s(model, batch, length, steps, model_config(shape).vocab_size)
    flops = (6 if mode == "full" else 4) * active_param_count(model_config(shape)) * batch * length
    return dict(shape=shape, mode=mode, tokens_per_s=round(batch * length / step, 1),
                gflops_per_s=round(flops / step / 1e9, 1),
                fraction_of_peak=round(flops / step / 1e9 / peak, 3))  # fmt: skip


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
    n = active_param_count(cfg)  # a MoE model's decode reads only the picked experts, on average
    peak, bandwidth = matmul_peak(256 if args.quick else None), read_bandwidth(64 if args.quick else None)
    rows = []
    for mode in args.modes.split(","):
        rows.append(train_point(args.shape, mode, args.batch, args.length, args.steps, peak))
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
