"""Where a model string's files are and what the model is, without JAX.

`locate_model` turns a hub name or a local directory into a directory (the local HF cache first, the
hub only when it is reachable and not switched off with `HF_HUB_OFFLINE=1`); `describe_model` reads its
`config.json` into the `ModelInfo` the API validates requests with (an unsupported architecture is a
`ValueError` listing the supported ones); `weight_bytes` sizes the text model's weights from the
safetensors headers, so a load can be refused before it starts. The API (which must not load JAX to
answer a request) and the engine both read models through these functions, so they agree.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from tx.models.config import load_hf_config
from tx.models.safetensors_io import DTYPES, read_header, shard_files
from tx.protocol import ModelInfo

HF_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.json", "tokenizer*", "*.txt", "*.model")
SKIPPED_PARTS = ("model.visual.", "mtp.")  # tensors of parts we never run (vision tower, multi-token head)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def is_hub_name(name: str) -> bool:
    return not name.startswith(("/", ".", "~")) and name.count("/") == 1


def locate_model(name_or_dir: str) -> Path:
    """A local directory as is; otherwise a hub name, taken from the local HF cache or downloaded."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if not is_hub_name(name_or_dir):
        raise FileNotFoundError(f"no model directory at {name_or_dir!r} (and it is not a hub name like 'org/model')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_dir, allow_patterns=list(HF_FILES), local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"{name_or_dir!r} is not a local directory and is not in the HF cache (offline mode)")
    try:
        return Path(snapshot_download(name_or_dir, allow_patterns=list(HF_FILES)))
    except Exception as err:
        raise FileNotFoundError(
            f"cannot fetch {name_or_dir!r} from the Hugging Face hub ({type(err).__name__}); "
            "pass a local model directory instead"
        ) from err


def describe_model(
    name: str, model_dir: Path, max_seq_len: int, max_lora_rank: int = 32, max_lora_adapters: int = 8
) -> ModelInfo:
    """The `ModelInfo` of the model in `model_dir`, served under `name`. A hub name lets a client on another
    machine resolve the tokenizer itself; a local directory is only meaningful to clients that share this
    filesystem, so it is returned as a path."""
    cfg = load_hf_config(model_dir)
    return ModelInfo(
        base_model=name,
        vocab_size=cfg.vocab_size,
        max_seq_len=min(max_seq_len, cfg.max_position_embeddings),
        tokenizer_id=name if is_hub_name(name) and not Path(name).expanduser().is_dir() else str(model_dir),
        max_lora_rank=max_lora_rank,
        max_lora_adapters=max_lora_adapters,
        arch=cfg.family,
    )


def weight_bytes(model_dir: Path, dtype: str | None) -> int:
    """Bytes the text model's weights take once loaded in `dtype` (None: each tensor's checkpoint dtype)."""
    total = 0
    for file in shard_files(model_dir):
        header, _ = read_header(file)
        for name, tensor in header.items():
            if name.startswith(SKIPPED_PARTS):
                continue
            size = DTYPE_BYTES[dtype] if dtype else DTYPES[tensor["dtype"]].itemsize
            total += math.prod(tensor["shape"]) * size
    return total
