"""Prepare an offline HF_HOME so tinker-cookbook 0.6.1 recipes run unmodified against SmolGym.

`sl_loop` and `rl_loop` have no `renderer_name` option: they look the renderer up from an `org/model`
name (a local path raises "Unknown model") and load `HuggingFaceH4/no_robots` / `openai/gsm8k`.
This script puts a small local model into the hub cache under a Qwen3 name (default `Qwen/Qwen3-8B`,
renderer qwen3) and writes tiny stand-ins for the two datasets into the datasets cache, so with
`HF_HOME=<dir> HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1` both the server (`--base-model Qwen/Qwen3-8B`)
and the cookbook resolve everything locally.

    python tests/e2e/cookbook_offline.py --model-dir /tmp/models/tiny --hf-home /tmp/cbhf
    python tests/e2e/cookbook_offline.py --tiny-qwen3-5 /tmp/models/q35 --hf-home /tmp/cbhf \
        --model-name Qwen/Qwen3.5-9B-Base    # the recipes' default model, a tiny hub-style Qwen3.5
    python tests/e2e/cookbook_offline.py --tiny-qwen3-5 /tmp/models/q35t --seed 1 --hf-home /tmp/cbhf \
        --model-name Qwen/Qwen3.5-9B         # on-policy distillation's default teacher, other weights

It also writes a stand-in for `zwhe99/DeepMath-103K` (the distillation recipe's default prompts).

Needs `datasets` and `pyarrow` (run it with the cookbook's interpreter). Not a test: pytest skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path

SHA = "0" * 40


def _hub_dir(hf_home: Path, kind: str, repo: str) -> Path:
    root = hf_home / "hub" / f"{kind}--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SHA)
    snapshot = root / "snapshots" / SHA
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def install_model(hf_home: Path, model_dir: Path, name: str) -> None:
    snapshot = _hub_dir(hf_home, "models", name)
    for path in model_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, snapshot / path.name)


def _conversation(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    question = f"What is {a} plus {b}?"
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": f"The answer is {a + b}."}]
    return {"prompt": question, "prompt_id": str(i), "messages": messages, "category": "Chat"}


def _gsm8k(rng: random.Random, _i: int) -> dict:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}


def install_dataset(hf_home: Path, repo: str, config: str, make, n_train: int = 64, n_test: int = 16) -> Path:
    """Write parquet splits and prepare them into `datasets/{org}___{name}/{config}/0.0.0/<hash>`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    rng = random.Random(0)
    snapshot = _hub_dir(hf_home, "datasets", repo)
    files = {}
    for split, n in (("train", n_train), ("test", n_test)):
        path = snapshot / config / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([make(rng, i) for i in range(n)]), path)
        files[split] = [str(path)]
    os.environ["HF_DATASETS_CACHE"] = str(hf_home / "datasets")
    builder = Parquet(
        dataset_name=repo.split("/")[1],
        config_name=config,
        data_files=DataFilesDict.from_patterns(files, base_path="/"),
        hash=SHA[:16],
        cache_dir=str(hf_home / "datasets"),
    )
    builder.download_and_prepare()
    src = Path(builder.cache_dir)
    org, name = repo.split("/")
    # Where `datasets` looks for it offline: the name in snake case (DeepMath-103K -> deep_math-103_k).
    cached = f"{org}___{camelcase_to_snakecase(name)}"
    dst = hf_home / "datasets" / cached / config / src.parent.name / src.name
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    shutil.rmtree(src.parents[2], ignore_errors=True)  # the builder's own `<name>/<config-hash>/` tree
    return dst


def _deepmath(rng: random.Random, _i: int) -> dict:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return {"question": f"What is {a} times {b}?", "final_answer": str(a * b), "difficulty": 1.0}


def write_tiny_qwen3_5(out: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 as the hub ships it (`Qwen3_5ForConditionalGeneration`, vision tower
    included) with SmolGym's tiny BPE tokenizer and chat template."""
    import sys

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tx.models import tiny

    tokenizer = tiny.train_tokenizer()
    eos = tokenizer.token_to_id(tiny.EOS)
    text = dict(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
        eos_token_id=eos, tie_word_embeddings=True,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4)
    torch.manual_seed(seed)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, eos_token_id=eos)
    Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tiny.tokenizer_config(), indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="local HF model dir with tokenizer")
    parser.add_argument("--hf-home", type=Path, required=True)
    parser.add_argument("--model-name", default="Qwen/Qwen3-8B", help="hub name the recipes and server use")
    parser.add_argument(
        "--tiny-qwen3-5", type=Path, help="build a tiny hub-style Qwen3.5 here and publish it (instead of --model-dir)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed of the tiny Qwen3.5")
    args = parser.parse_args()
    if (args.model_dir is None) == (args.tiny_qwen3_5 is None):
        parser.error("give exactly one of --model-dir and --tiny-qwen3-5")
    model_dir = args.model_dir or write_tiny_qwen3_5(args.tiny_qwen3_5, args.seed)
    install_model(args.hf_home, model_dir, args.model_name)
    print(install_dataset(args.hf_home, "HuggingFaceH4/no_robots", "default", _conversation))
    print(install_dataset(args.hf_home, "openai/gsm8k", "main", _gsm8k))
    print(install_dataset(args.hf_home, "zwhe99/DeepMath-103K", "default", _deepmath))
    print(f"export HF_HOME={args.hf_home} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; model name {args.model_name}")


if __name__ == "__main__":
    main()
