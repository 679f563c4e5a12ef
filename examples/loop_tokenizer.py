"""The tokenizer both example loops use (imported from their own directory)."""

from __future__ import annotations

import tinker


def load_tokenizer(client: tinker.TrainingClient, base_model: str, tokenizer: str | None):
    """`--tokenizer` if given; else the server's (its tokenizer id); else the base model's own from transformers.
    An upload whose files record no hub name has no tokenizer a client can resolve (its id is `upload:NAME`)."""
    from transformers import AutoTokenizer

    if tokenizer:
        return AutoTokenizer.from_pretrained(tokenizer)
    tokenizer_id = client.get_info().model_data.tokenizer_id or ""  # the SDK cuts it at ":" (`upload:NAME`)
    if base_model.startswith("upload:") and "/" not in tokenizer_id:
        raise SystemExit(
            f"{base_model} names no tokenizer this machine can load: pass --tokenizer DIR (the uploaded one)"
        )
    try:
        return client.get_tokenizer()
    except Exception:
        return AutoTokenizer.from_pretrained(base_model)
