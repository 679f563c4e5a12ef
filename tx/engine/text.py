"""A model's token-to-text decoder (the sampler's stop strings) and its end-of-sequence ids.

A model directory with a `tokenizer.json` is read by the `tokenizers` library itself: the same Rust
decoder a transformers fast tokenizer wraps, in 15 ms and 12 MiB, where `AutoTokenizer` imported
transformers' tokenizer stack and torch with it (2.2 s and over 200 MiB of a `small` server's start-up,
before it could answer). transformers reads the directory only when there is no `tokenizer.json` (a
slow, sentencepiece-only tokenizer) or when its config asks for the clean-up of tokenization spaces,
which only transformers applies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tx.engine.errors import EXITS

log = logging.getLogger("tx.engine")

Decode = Callable[[list[int]], str]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "*.model", "vocab.*", "merges.txt")


def load_decoder(model_dir: Path) -> tuple[Decode, list[int]]:
    """(token ids -> text, "" for every tokens when the directory has no usable tokenizer; the
    end-of-sequence ids)."""
    settings = _json(model_dir / "tokenizer_config.json")
    try:
        decode, eos_from_tokenizer = _fast(model_dir, settings) or _transformers(model_dir)
    except EXITS:
        raise
    except BaseException as err:  # a model directory without a usable tokenizer still trains and samples
        # The message as text: a record holding `err` would hold its traceback, and with it the frames of
        # the engine build that called this (its model's weights), for as long as a log handler keeps it.
        log.warning("no tokenizer in %s (%s): stop strings are unavailable", model_dir, str(err))
        return _no_text, _configured_eos(model_dir)
    return _contained(decode), _configured_eos(model_dir) or eos_from_tokenizer


def _contained(decode: Decode) -> Decode:
    """`decode` whose native panics are ValueErrors: a hostile `tokenizer.json` (a decoder regex that backtracks
    past onig's retry limit) panics inside `tokenizers`, and the sampler then fails that request alone."""

    def safe(tokens: list[int]) -> str:
        try:
            return decode(tokens)
        except EXITS:
            raise
        except BaseException as err:  # pyo3's PanicException is not an Exception
            raise ValueError(f"the model's tokenizer failed to decode: {type(err).__name__}: {err}") from None

    return safe


def _configured_eos(model_dir: Path) -> list[int]:
    """The end-of-sequence ids generation_config.json (else config.json) names, [] when neither does. Only
    whole numbers count: `1.5` raised when the model loaded, and `[[1]]` failed every sample later."""
    for name in ("generation_config.json", "config.json"):
        value = _json(model_dir / name).get("eos_token_id")
        if value is not None:
            values = value if isinstance(value, list) else [value]
            return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return []


def _fast(model_dir: Path, settings: dict[str, Any]) -> tuple[Decode, list[int]] | None:
    """The `tokenizers` decoder of `tokenizer.json`; None when transformers must read the directory."""
    if not (model_dir / "tokenizer.json").is_file() or settings.get("clean_up_tokenization_spaces"):
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos_token = settings.get("eos_token")
    eos_text = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    eos_id = tokenizer.token_to_id(eos_text) if isinstance(eos_text, str) else None

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False)

    return decode, [] if eos_id is None else [eos_id]


def _transformers(model_dir: Path) -> tuple[Decode, list[int]]:
    if not any(any(model_dir.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise FileNotFoundError("no tokenizer files")  # transformers would make an empty tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens))

    return decode, eos


def _no_text(tokens: list[int]) -> str:
    return ""


def has_text(decode: Decode) -> bool:
    """Whether `decode` turns tokens into text: False for the decoder of a model without a tokenizer, where a
    stop string could never match."""
    return decode is not _no_text


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
