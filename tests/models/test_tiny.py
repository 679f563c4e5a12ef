"""The built-in tiny model: a complete HF directory that both `tx` and `transformers` load identically."""

import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tx.models.tiny import write_tiny_model
from tx.models.weights import load_model


def test_tiny_model_loads_in_tx_and_transformers_with_matching_logits(tmp_path):
    path = write_tiny_model(tmp_path / "models" / "tiny-qwen3")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert write_tiny_model(path) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == tokenizer.eos_token_id
    text = "The cat sat on the mat. Héllo!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")

    torch_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, cfg = load_model(str(path), progress=False)
    assert cfg.vocab_size == len(tokenizer) and cfg.tie_word_embeddings
    tokens = np.asarray([ids[:12]], np.int32)
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ours, _ = model(tokens)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
