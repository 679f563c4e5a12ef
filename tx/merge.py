"""`python -m tx.merge ADAPTER OUT`: a trained LoRA adapter (the PEFT directory `save_weights_for_sampler`
writes, or its downloaded archive unpacked) merged into its base model, written as a plain Hugging Face
model directory that `transformers` loads without `peft`.

The base is the adapter's `base_model_name_or_path` (a hub name, resolved as the server resolves it: the
local cache offline) unless `--base` names another directory. See `tx.lora.merge` for what is written.
Mixture-of-experts adapters merge into each expert's weights, per-expert or fused as the base stores them; a
gpt-oss base in MXFP4 is written with its experts dequantized (bfloat16 unless `--dtype`), no longer MXFP4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tx.lora.merge import merge_to_hf
from tx.lora.peft import CONFIG_NAME, load_peft
from tx.models.catalog import locate_model
from tx.models.gpt_oss_checkpoint import MXFP4Experts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tx.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", type=Path, help="PEFT adapter directory (adapter_config.json + safetensors)")
    parser.add_argument("out", type=Path, help="output directory (replaced atomically)")
    parser.add_argument("--base", help="base model directory or hub name (default: the adapter's own base)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast floating tensors")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        base = args.base or json.loads((args.adapter / CONFIG_NAME).read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{args.adapter} names no base model; pass --base")
        base_dir = locate_model(base)
        gpt_oss = json.loads((base_dir / "config.json").read_text()).get("model_type") == "gpt_oss"
        config, weights = load_peft(args.adapter, fused_gate_up=gpt_oss)  # gpt-oss adapts gate_up whole
        dequantizer = MXFP4Experts() if gpt_oss else None
        merge_to_hf(base_dir, args.out, config, weights, dtype=args.dtype, dequantizer=dequantizer)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {base}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
