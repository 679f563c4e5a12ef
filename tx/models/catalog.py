"""Where a model string's files are and what the model is, without JAX.

`locate_model` turns a hub name or a local directory into a directory with the weights (the local HF
cache first, the hub only when it is reachable and not switched off with `HF_HUB_OFFLINE=1`);
`locate_config` finds (or fetches) only its `config.json`, so the API can answer at once and leave the
download of the weights to the engine's loader; `describe_model` reads its
`config.json` into the `ModelInfo` the API validates requests with (an unsupported architecture is a
`ValueError` listing the supported ones); `weight_bytes` sizes the text model's weights from the
safetensors headers, so a load can be refused before it starts. The API (which must not load JAX to
answer a request) and the engine both read models through these functions, so they agree.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from tx.models.config import load_hf_config
from tx.models.safetensors_io import DTYPES, read_header, shard_files
from tx.protocol import ModelInfo

HF_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.json", "tokenizer*", "*.txt", "*.model")
SKIPPED_PARTS = ("model.visual.", "mtp.")  # tensors of parts we never run (vision tower, multi-token head)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# Tinker's model ids may name a variant after the hub name: `Qwen/Qwen3.6-35B-A3B:peft:262144` is the hub model
# trained with LoRA at a context of at most 262144 tokens (tinker-cookbook's `rl_numerics_check` default).
_VARIANT = re.compile(r"(?P<base>[A-Za-z0-9][\w.-]*/[\w.-]+):peft(?::(?P<context>[1-9][0-9]{0,8}))?")


def split_variant(name: str) -> tuple[str, int | None]:
    """A variant's hub name and its context cap (None: no cap); any other model string as is, None."""
    found = _VARIANT.fullmatch(name)
    if found is None:
        return name, None
    return found["base"], int(found["context"]) if found["context"] else None


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
        cached = Path(snapshot_download(name_or_dir, allow_patterns=list(HF_FILES), local_files_only=True))
        if has_weights(cached):  # a snapshot may hold only the config.json `locate_config` fetched
            return cached
    except Exception:
        pass
    if hub_offline():
        raise FileNotFoundError(
            f"{name_or_dir!r} is not a local directory and is not in the HF cache (offline mode: HF_HUB_OFFLINE is "
            f"set); download it once with `hf download {name_or_dir}`, or unset HF_HUB_OFFLINE"
        )
    try:
        return Path(snapshot_download(name_or_dir, allow_patterns=list(HF_FILES)))
    except Exception as err:
        raise FileNotFoundError(
            f"cannot fetch {name_or_dir!r} from the Hugging Face hub ({type(err).__name__}); "
            "pass a local model directory instead"
        ) from err


def locate_config(name_or_dir: str) -> Path:
    """The directory holding `config.json` of a local directory or a hub name: the name's cached snapshot, or
    (online) a snapshot with the config alone, fetched in a moment whatever the size of the weights."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() or not is_hub_name(name_or_dir):
        return locate_model(name_or_dir)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(name_or_dir, "config.json", local_files_only=hub_offline())).parent
    except Exception as err:
        offline = hub_offline()
        where = "is not in the HF cache (offline mode)" if offline else f"cannot be fetched ({type(err).__name__})"
        raise FileNotFoundError(f"{name_or_dir!r} is not a local directory and {where}") from err


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors"))


def describe_model(
    name: str,
    model_dir: Path,
    max_seq_len: int,
    max_lora_rank: int = 128,
    max_lora_adapters: int = 8,
    private_dir: bool = False,
) -> ModelInfo:
    """The `ModelInfo` of the model in `model_dir`, served under `name` (`tokenizer_id_for` says which
    tokenizer name clients are given; `private_dir`: the directory is the server's own, an upload's)."""
    cfg = load_hf_config(model_dir)
    return ModelInfo(
        base_model=name,
        vocab_size=cfg.vocab_size,
        max_seq_len=min(max_seq_len, cfg.max_position_embeddings),
        tokenizer_id=tokenizer_id_for(name, model_dir, private_dir),
        max_lora_rank=max_lora_rank,
        max_lora_adapters=max_lora_adapters,
        arch=cfg.family,
    )


def tokenizer_id_for(name: str, model_dir: Path, private_dir: bool) -> str:
    """What a client passes to `AutoTokenizer.from_pretrained`: a hub name as is (a client on another machine
    resolves it itself); a local directory as its absolute path (meaningful to clients on this filesystem). A private
    directory (an upload) is never named: the hub name its files record (`tokenizer_config.json`'s
    `name_or_path`, `config.json`'s `_name_or_path`), else the model string itself."""
    if is_hub_name(name) and not Path(name).expanduser().is_dir():
        return name
    if not private_dir:
        return str(model_dir.absolute())  # `./model` means nothing from a client's working directory
    for file, key in (("tokenizer_config.json", "name_or_path"), ("config.json", "_name_or_path")):
        try:
            recorded = json.loads((model_dir / file).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recorded, str) and is_hub_name(recorded):
            return recorded
    return name


def exported_base_name(name: str, model_dir: Path) -> str:
    """The base model an exported adapter names (`base_model_name_or_path`): a local directory by its absolute
    path, so `tx.merge` or `peft` finds it from any working directory; a hub name or an upload as is."""
    if name.startswith("upload:") or not Path(name).expanduser().is_dir():
        return name
    return str(model_dir.absolute())


def weight_bytes(model_dir: Path, dtype: str | None) -> int:
    """Bytes the text model's weights take once loaded in `dtype` (None: each tensor's checkpoint dtype)."""
    total = 0
    for file in shard_files(model_dir):
        header, _ = read_header(file)
        for name, tensor in header.items():
            if name.startswith(SKIPPED_PARTS):
                continue
            total += _loaded_bytes(name, tensor, dtype)
    return total


def _loaded_bytes(name: str, tensor: dict, dtype: str | None) -> int:
    """One stored tensor's bytes once loaded. gpt-oss's MXFP4 experts: a `*_blocks` byte holds two weights,
    which load in `dtype` (the hub's bfloat16 when None); their `*_scales` load as nothing of their own."""
    count = math.prod(tensor["shape"])
    if tensor["dtype"] == "U8" and name.endswith("_scales"):
        return 0
    if tensor["dtype"] == "U8" and name.endswith("_blocks"):
        return 2 * count * (DTYPE_BYTES[dtype] if dtype else 2)
    return count * (DTYPE_BYTES[dtype] if dtype else DTYPES[tensor["dtype"]].itemsize)
