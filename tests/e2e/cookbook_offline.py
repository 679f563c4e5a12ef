"""Prepare an offline HF_HOME so tinker-cookbook 0.6.1 recipes run unmodified against SmolGym.

`sl_loop` and `rl_loop` have no `renderer_name` option: they look the renderer up from an `org/model`
name (a local path raises "Unknown model") and load `HuggingFaceH4/no_robots` / `openai/gsm8k`.
This script puts a small local model into the hub cache under a Qwen3 name (default `Qwen/Qwen3-8B`,
renderer qwen3) and writes tiny stand-ins for the two datasets into the datasets cache, so with
`HF_HOME=<dir> HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1` both the server (`--base-model Qwen/Qwen3-8B`)
and the cookbook resolve everything locally.

    python tests/e2e/cookbook_offline.py --model-dir /tmp/models/tiny --hf-home /tmp/cbhf

Needs `datasets` and `pyarrow` (run it with the cookbook's interpreter). Not a test: pytest skips it.
"""

from __future__ import annotations

import argparse
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
    dst = hf_home / "datasets" / repo.replace("/", "___") / config / src.parent.name / src.name
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    shutil.rmtree(src.parents[2], ignore_errors=True)  # the builder's own `<name>/<config-hash>/` tree
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="local HF model dir with tokenizer")
    parser.add_argument("--hf-home", type=Path, required=True)
    parser.add_argument("--model-name", default="Qwen/Qwen3-8B", help="hub name the recipes and server use")
    args = parser.parse_args()
    install_model(args.hf_home, args.model_dir, args.model_name)
    print(install_dataset(args.hf_home, "HuggingFaceH4/no_robots", "default", _conversation))
    print(install_dataset(args.hf_home, "openai/gsm8k", "main", _gsm8k))
    print(f"export HF_HOME={args.hf_home} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; model name {args.model_name}")


if __name__ == "__main__":
    main()
