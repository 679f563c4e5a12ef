"""What the server checks before it registers an uploaded model directory.

`check_upload(model_dir)` is the store's validation hook (`UploadStore.finish`): the config is parsed and
must be a supported architecture, every tensor's name, shape and dtype must fit the model it builds
(`tx.models.checkpoint_check`, headers only), and the tokenizer must load with `transformers` (offline,
no remote code) with no more tokens than the model's vocabulary, and its decoder may not replace text by
regular expression (`_check_decoder`). Any failure is a `ValueError` whose
message names the file, the tensor or the field. `check_config` is the same config check on the config
a client declares when it starts an upload, so an unsupported model is refused before its weights move.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check_config(config: dict[str, Any]) -> None:
    """`ValueError` unless `config` (a parsed config.json) is a model this server can build."""
    from tx.models.config import ModelConfig

    try:
        ModelConfig.from_hf(config)
    except (KeyError, TypeError) as err:
        raise ValueError(f"config.json is missing or mistypes a field ({err})") from None


def check_upload(model_dir: Path) -> dict[str, Any]:
    """The upload's facts (`architecture`, `max_context_length`) once every check passed. Messages name
    files by their name in the upload, never by their place on the server. Whatever the files make the
    checks raise refuses the upload (a config of `[]` raised AttributeError: a 500, its staging kept)."""
    try:
        return _check(model_dir)
    except Exception as err:
        shown = str(err) if isinstance(err, ValueError | FileNotFoundError) else f"{type(err).__name__}: {err}"
        raise ValueError(shown.replace(str(model_dir) + "/", "").replace(str(model_dir), "the upload")) from None


def _check(model_dir: Path) -> dict[str, Any]:
    from tx.models.checkpoint_check import check_checkpoint

    cfg = check_checkpoint(model_dir)
    _check_decoder(model_dir / "tokenizer.json")
    tokens = _tokenizer_size(model_dir)
    if tokens > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokens} tokens, more than the model's vocab_size {cfg.vocab_size}")
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or [cfg.family]
    return {"architecture": str(architectures[0]), "max_context_length": cfg.max_position_embeddings}


def _check_decoder(tokenizer_json: Path) -> None:
    """Refuse a decoder that replaces by regular expression. The sampler decodes every row's new tokens on the
    engine thread to match stop strings, holding the GIL: a pattern that backtracks just under the regex
    engine's limit (0.1 s a token) froze sampling and HTTP for every tenant. Hub tokenizers replace plain
    strings ("▁" with " "), which is allowed."""
    if not tokenizer_json.is_file():
        return
    try:
        decoder = json.loads(tokenizer_json.read_text()).get("decoder")
    except (ValueError, AttributeError):
        return  # an unreadable tokenizer.json is the tokenizer check's to refuse
    stack = [decoder]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            pattern = node.get("pattern")
            if node.get("type") == "Replace" and isinstance(pattern, dict) and "Regex" in pattern:
                raise ValueError("tokenizer.json's decoder replaces by regular expression, which this server does "
                                 "not run (a slow pattern would stall every tenant's sampling)")  # fmt: skip
            stack.extend(node.values())


def _tokenizer_size(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers raises many kinds; any of them means it does not load
        raise ValueError(f"the tokenizer does not load with transformers ({type(err).__name__}: {err})") from None
    return len(tokenizer)
