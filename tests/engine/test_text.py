"""The sampler's token decoder (`tx.engine.text`): the `tokenizers` reading of tokenizer.json decodes as
transformers' AutoTokenizer does, finds the same end-of-sequence id, falls back to transformers where
only it applies, and building an engine imports neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from tx.engine.text import load_decoder
from tx.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("text") / "tiny")


def copy_with(tiny_dir: Path, dest: Path, drop: tuple[str, ...] = (), settings: dict | None = None) -> Path:
    shutil.copytree(tiny_dir, dest)
    for name in drop:
        (dest / name).unlink()
    if settings is not None:
        config = json.loads((dest / "tokenizer_config.json").read_text())
        (dest / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    return dest


def test_decodes_as_transformers_does_special_tokens_included(tiny_dir: Path) -> None:
    decode, eos = load_decoder(tiny_dir)
    reference = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert eos == [reference.eos_token_id]
    rng = np.random.default_rng(0)
    specials = list(reference.all_special_ids)
    for length in (1, 2, 7, 40):
        ids = [int(t) for t in rng.integers(0, len(reference), length)] + specials
        assert decode(ids) == reference.decode(ids)
    text = "Hello and goodbye, one two three."
    assert decode(reference.encode(text)) == reference.decode(reference.encode(text))


def test_eos_comes_from_the_tokenizer_config_when_the_model_configs_name_none(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_with(tiny_dir, tmp_path / "m", drop=("generation_config.json",))
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("eos_token_id", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    _, eos = load_decoder(model_dir)
    assert eos == [AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id] and eos[0] is not None


def test_eos_ids_that_are_not_whole_numbers_are_left_out(tiny_dir: Path, tmp_path: Path) -> None:
    """generation_config.json's `eos_token_id: 1.5` raised when the model loaded; `[[1]]` failed every
    sample. Only whole numbers count; with none, the tokenizer's end-of-sequence token is used."""
    tokenizers = load_decoder(tiny_dir)[1]
    for value, want in ((1.5, tokenizers), ([[1]], tokenizers), ([2, "x", 3, True, -1], [2, 3]), (7, [7])):
        model_dir = copy_with(tiny_dir, tmp_path / f"m{len(list(tmp_path.iterdir()))}")
        (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert load_decoder(model_dir)[1] == want, value


def test_transformers_reads_what_only_it_can(tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cleaned = copy_with(tiny_dir, tmp_path / "clean", settings={"clean_up_tokenization_spaces": True})
    decode, _ = load_decoder(cleaned)
    reference = AutoTokenizer.from_pretrained(str(cleaned))
    ids = reference.encode("one , two . three !")  # transformers 5 keeps a BPE tokenizer's spaces even so
    assert decode(ids) == reference.decode(ids)
    bare = copy_with(tiny_dir, tmp_path / "bare", drop=("tokenizer.json", "tokenizer_config.json"))
    decode, eos = load_decoder(bare)
    configured = json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"]
    assert decode([1, 2, 3]) == "" and eos == [configured]
    assert "stop strings are unavailable" in caplog.text


def test_building_an_engine_imports_neither_transformers_nor_torch(tiny_dir: Path, tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path\n"
        "from tx.engine import build_runner\n"
        "from tx.engine.config import EngineConfig\n"
        f"runner, info = build_runner(EngineConfig(base_model='tiny', data_dir=Path({str(tmp_path)!r})), "
        f"Path({str(tiny_dir)!r}))\n"
        "assert runner is not None\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_tokenizer_that_panics_raises_a_value_error(tmp_path: Path) -> None:
    """A decoder regex that backtracks past onig's retry limit panics inside `tokenizers`; the panic is pyo3's
    PanicException, a BaseException, and escaped every `except Exception` up to the engine thread, which died
    (the server kept queueing work nobody ran). Decoding now raises ValueError: the sampler fails that request."""
    from tokenizers import Regex, Tokenizer, decoders, models

    from tx.engine.sampling import StopChecker

    tokenizer = Tokenizer(models.WordLevel({"a" * 100: 0, "b": 1}, unk_token="b"))
    tokenizer.decoder = decoders.Replace(Regex("(a|aa)+c"), "x")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    decode, _ = load_decoder(tmp_path)
    assert decode([1]) == "b"
    with pytest.raises(ValueError, match="tokenizer failed to decode: PanicException"):
        decode([0, 0])
    with pytest.raises(ValueError, match="PanicException"):
        StopChecker([], ["zz"], decode, 16).check([0, 0], 2)
