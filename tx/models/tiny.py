"""A tiny random-weight Hugging Face model directory, written offline without torch.

`write_tiny_model` produces what `from_pretrained` expects of a real checkpoint (config.json,
generation_config.json, model.safetensors with HF tensor names, tokenizer.json + tokenizer_config.json)
so the demo and tests exercise the same loading path as a downloaded model. The tokenizer is a
byte-level BPE trained on a few built-in paragraphs; the model's vocabulary is exactly the tokenizer's.
The directory is written to a temporary sibling and renamed into place, so a present directory is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|im_end|>"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab_target=512)

CORPUS = """\
The small model reads a sentence and guesses the next word. At first every guess is poor, because the
weights are random numbers, but each step of training moves them a little toward better guesses.
A cat sat on the warm mat by the door. The dog ran across the green field to meet the children, and
the children laughed as they threw a red ball into the air. The sun was bright and the sky was blue.
In the morning the baker opens the shop early. She makes bread, cakes and small sweet rolls, and the
people of the town come in one by one to buy what they need for the day. The bread is still warm.
Learning is a loop: try something, see how well it worked, and change a little. A teacher gives a
score, the student adjusts, and over many rounds the answers get better. This is how reinforcement
learning works, and it is also how people learn to ride a bicycle or to play a song on the piano.
The river runs down from the hills to the sea. Along the way it passes farms, old stone bridges and
quiet villages where boats rest on the water. In the evening the light turns gold and the birds sing.
Numbers are words too: one, two, three, four, five, six, seven, eight, nine and ten. Yes and no are
short answers. Hello and goodbye are the first and the last words of many conversations.
"""


def write_tiny_model(out_dir: str | Path, family: str = "qwen3") -> Path:
    """Write (once) a tiny random Qwen3 checkpoint with its tokenizer to `out_dir`; return the directory."""
    if family != "qwen3":
        raise ValueError(f"only family 'qwen3' is supported, got {family!r}")
    out = Path(out_dir).expanduser().absolute()
    if all((out / name).is_file() for name in FILES):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = train_tokenizer()
        vocab = tokenizer.get_vocab_size()
        tokenizer.save(str(tmp / "tokenizer.json"))
        eos_id = tokenizer.token_to_id(EOS)
        assert eos_id is not None
        _write_json(tmp / "tokenizer_config.json", tokenizer_config())
        _write_json(tmp / "config.json", hf_config(vocab, eos_id))
        _write_json(tmp / "generation_config.json", {"eos_token_id": eos_id, "do_sample": True})
        save_file(random_weights(vocab), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 style, every byte representable) trained on `CORPUS`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_target"],
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n"), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }


def hf_config(vocab: int, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": SHAPE["hidden"],
        "intermediate_size": SHAPE["mlp"],
        "num_hidden_layers": SHAPE["layers"],
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"],
        "head_dim": SHAPE["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "dtype": "float32",
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
        "bos_token_id": None,
    }


def random_weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors: linear weights [out, in] ~ N(0, 0.02), norms at one."""
    rng = np.random.default_rng(seed)
    D, E, F = SHAPE["hidden"], SHAPE["head_dim"], SHAPE["mlp"]
    H, K = SHAPE["heads"], SHAPE["kv_heads"]

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, D), "model.norm.weight": np.ones(D, np.float32)}
    for i in range(SHAPE["layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (H * E, D),
            "self_attn.k_proj": (K * E, D),
            "self_attn.v_proj": (K * E, D),
            "self_attn.o_proj": (D, H * E),
            "mlp.gate_proj": (F, D),
            "mlp.up_proj": (F, D),
            "mlp.down_proj": (D, F),
        }
        tensors.update({f"{p}{name}.weight": normal(*shape) for name, shape in shapes.items()})
        for norm, size in (("self_attn.q_norm", E), ("self_attn.k_norm", E), ("input_layernorm", D)):
            tensors[f"{p}{norm}.weight"] = np.ones(size, np.float32)
        tensors[f"{p}post_attention_layernorm.weight"] = np.ones(D, np.float32)
    return tensors


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
