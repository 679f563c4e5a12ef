"""PEFT import/export parity: tiny Qwen3/Llama models and real `peft` adapters, compared in float32."""

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tx.lora import peft as txpeft  # noqa: E402
from tx.lora.peft import AdapterConfig, load_peft, save_peft  # noqa: E402

pytestmark = pytest.mark.parity

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {"qwen3-tied": (transformers.Qwen3Config, True), "llama-untied": (transformers.LlamaConfig, False)}
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def build_base(path: Path, family: str, max_shard_size: str | None = None) -> Path:
    """Save a random tiny model of `family` to `path` and return it."""
    config_cls, tied = FAMILIES[family]
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def load_base(base: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def make_peft(base: Path, **lora_kwargs):
    """A PEFT model on `base` with random non-zero lora_B (PEFT initialises B to zero)."""
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ATTN_MLP + ["lm_head"], **lora_kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about LoRA on a tied lm_head; that case is the point
        model = peft.get_peft_model(load_base(base), peft.LoraConfig(**kwargs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(IDS).logits.float().numpy()


def saved_peft(tmp: Path, base: Path, **lora_kwargs):
    model = make_peft(base, **lora_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp)
    return model


def assert_reloads_in_peft(base: Path, adapter: Path, expected: np.ndarray) -> None:
    """`adapter` loads into PEFT with no missing/unexpected keys and reproduces `expected` logits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(load_base(base), adapter).eval()
        result = model.load_adapter(adapter, adapter_name="check")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert not [w for w in caught if any(s in str(w.message).lower() for s in ("missing", "unexpected", "keyword"))]
    np.testing.assert_allclose(logits(model), expected, atol=1e-5, rtol=0)


def peft_delta(model, module: str) -> np.ndarray:
    layer = model.get_submodule(f"base_model.model.{module}")
    return layer.get_delta_weight("default").detach().numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def base(request, tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp(request.param), request.param)


def test_load_matches_peft_state_dict(base, tmp_path):
    model = saved_peft(tmp_path / "a", base, use_rslora=False)
    config, weights = load_peft(tmp_path / "a")
    assert (config.rank, config.alpha, config.scaling, config.use_rslora) == (4, 8.0, 2.0, False)
    assert config.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    )
    state = model.state_dict()
    assert len(weights) == 2 * 7 + 1
    for module, (a, b) in weights.items():
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, state[f"base_model.model.{module}.lora_A.default.weight"].numpy().T)
        np.testing.assert_array_equal(b, state[f"base_model.model.{module}.lora_B.default.weight"].numpy().T)


def test_save_reloads_in_peft_with_same_logits(base, tmp_path):
    model = saved_peft(tmp_path / "a", base)
    config, weights = load_peft(tmp_path / "a")
    save_peft(tmp_path / "ours", dataclasses.replace(config, base_model_name_or_path="tiny"), weights)
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["peft_type"] == "LORA" and written["task_type"] == "CAUSAL_LM"
    assert written["base_model_name_or_path"] == "tiny" and written["r"] == 4 and written["lora_alpha"] == 8
    assert_reloads_in_peft(base, tmp_path / "ours", logits(model))


def test_padded_rank_is_sliced(base, tmp_path):
    model = saved_peft(tmp_path / "a", base)
    config, weights = load_peft(tmp_path / "a")
    rng = np.random.default_rng(0)
    padded = {
        m: (
            np.concatenate([a, rng.normal(size=(a.shape[0], 4))], 1),
            np.concatenate([b, rng.normal(size=(4, b.shape[1]))]),
        )
        for m, (a, b) in weights.items()
    }
    save_peft(tmp_path / "padded", config, padded)
    _, reloaded = load_peft(tmp_path / "padded")
    for module, (a, b) in weights.items():
        np.testing.assert_array_equal(reloaded[module][0], a)
        np.testing.assert_array_equal(reloaded[module][1], b)
    assert_reloads_in_peft(base, tmp_path / "padded", logits(model))


def test_rslora(base, tmp_path):
    model = saved_peft(tmp_path / "a", base, r=4, lora_alpha=6, use_rslora=True)
    config, weights = load_peft(tmp_path / "a")
    assert config.use_rslora and config.scaling == pytest.approx(3.0)
    module = "model.layers.1.self_attn.v_proj"
    np.testing.assert_allclose(txpeft.lora_delta(config, *weights[module]), peft_delta(model, module), atol=1e-6)
    save_peft(tmp_path / "ours", config, weights)
    assert_reloads_in_peft(base, tmp_path / "ours", logits(model))


def test_regex_target_modules_resolve_from_keys(base, tmp_path):
    saved_peft(tmp_path / "a", base, target_modules=r".*\.(v_proj|q_proj|up_proj)")
    config, weights = load_peft(tmp_path / "a")
    assert config.target_modules == ("q_proj", "v_proj", "up_proj")
    assert sorted(weights) == sorted(
        f"model.layers.{i}.{m}" for i in range(2) for m in ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"]
    )


def test_rank_and_alpha_patterns_are_padded_and_folded(base, tmp_path):
    model = saved_peft(
        tmp_path / "a", base, r=4, rank_pattern={"q_proj": 2, "lm_head": 6}, alpha_pattern={"down_proj": 3}
    )
    config, weights = load_peft(tmp_path / "a")
    assert config.rank == 6 and config.alpha == 8.0
    for module in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
        "model.layers.0.mlp.up_proj",
    ]:
        np.testing.assert_allclose(txpeft.lora_delta(config, *weights[module]), peft_delta(model, module), atol=1e-6)
    save_peft(tmp_path / "ours", config, weights)
    assert_reloads_in_peft(base, tmp_path / "ours", logits(model))


def test_default_adapter_name_in_keys_is_accepted(base, tmp_path):
    saved_peft(tmp_path / "a", base, target_modules=["q_proj"])
    expected = load_peft(tmp_path / "a")
    file = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(str(file))
    save_file({k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, str(file))
    config, weights = load_peft(tmp_path / "a")
    assert config == expected[0] and weights.keys() == expected[1].keys()


@pytest.mark.parametrize(
    ("lora_kwargs", "message"),
    [
        ({"modules_to_save": ["lm_head"], "target_modules": ["q_proj"]}, "modules_to_save"),
        ({"use_dora": True, "target_modules": ["q_proj"]}, "DoRA"),
        ({"bias": "lora_only", "target_modules": ["q_proj"]}, "bias='lora_only'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"\['embed_tokens'\].*supported: \['q_proj'"),
        ({"target_modules": [], "target_parameters": ["self_attn.q_proj.weight"]}, "only a MoE block's fused"),
    ],
)
def test_unsupported_adapters_are_named(base, tmp_path, lora_kwargs, message):
    saved_peft(tmp_path / "a", base, **lora_kwargs)
    with pytest.raises(ValueError, match=message):
        load_peft(tmp_path / "a")


def test_embedding_lora_keys_are_refused_even_if_config_is_regex(base, tmp_path):
    saved_peft(tmp_path / "a", base, target_modules=r".*(embed_tokens|q_proj)")
    with pytest.raises(ValueError, match="embeddings.*supported targets"):
        load_peft(tmp_path / "a")


def test_pickled_adapter_asks_for_safetensors(base, tmp_path):
    saved_peft(tmp_path / "a", base, target_modules=["q_proj"])
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(ValueError, match="convert it to adapter_model.safetensors"):
        load_peft(tmp_path / "a")


def test_save_is_atomic(tmp_path, monkeypatch):
    config = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj",), base_model_name_or_path="m")
    weights = {"model.layers.0.self_attn.q_proj": (np.ones((8, 2), np.float32), np.ones((2, 8), np.float32))}
    save_peft(tmp_path / "ckpt", config, weights)
    save_peft(tmp_path / "ckpt", config, {k: (2 * a, b) for k, (a, b) in weights.items()})  # replaces
    assert np.all(load_peft(tmp_path / "ckpt")[1]["model.layers.0.self_attn.q_proj"][0] == 2)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(txpeft, "save_file", crash)
    with pytest.raises(OSError):
        save_peft(tmp_path / "new", config, weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_rejects_modules_outside_targets():
    config = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj",), base_model_name_or_path="m")
    with pytest.raises(ValueError, match="not in target_modules"):
        save_peft("/nonexistent", config, {"lm_head": (np.ones((8, 2)), np.ones((2, 8)))})
    with pytest.raises(ValueError, match="unsupported LoRA target modules"):
        AdapterConfig(rank=2, alpha=4.0, target_modules=("embed_tokens",), base_model_name_or_path="m")


def _ours(tmp_path: Path, **config) -> Path:
    """A two-module rank-2 adapter saved by save_peft from a default AdapterConfig."""
    cfg = AdapterConfig(**{"rank": 2, "alpha": 4.0, "target_modules": ("q_proj", "v_proj"),
                           "base_model_name_or_path": "org/base", **config})  # fmt: skip
    rng = np.random.default_rng(0)
    r = cfg.rank
    weights = {
        f"model.layers.0.self_attn.{m}": (rng.normal(size=(64, r)).astype(np.float32), rng.normal(size=(r, 32)))
        for m in cfg.target_modules
    }
    save_peft(tmp_path / "ours", cfg, weights)
    return tmp_path / "ours"


def test_the_config_we_write_says_what_peft_writes_for_the_same_adapter(tmp_path):
    """Every field of our adapter_config.json holds the value PEFT itself saves for a LoRA with this rank,
    alpha and targets (no dropout, no rsLoRA, PEFT's init), so PEFT and vLLM read the adapter as trained."""
    ours = json.loads((_ours(tmp_path) / "adapter_config.json").read_text())
    reference = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    reference.inference_mode = True  # as PeftModel.save_pretrained stores it
    reference.save_pretrained(tmp_path / "peft")
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (
        set(ours["target_modules"]) == set(theirs["target_modules"]) and ours["base_model_name_or_path"] == "org/base"
    )
    differ = {k: (v, theirs.get(k)) for k, v in ours.items() if k not in ("target_modules", "base_model_name_or_path")}
    assert {k: pair for k, pair in differ.items() if pair[0] != pair[1]} == {}


def test_a_config_without_optional_fields_loads_with_peft_defaults(tmp_path):
    path = _ours(tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    for field in ("use_rslora", "base_model_name_or_path", "bias", "rank_pattern", "alpha_pattern"):
        del raw[field]
    (path / "adapter_config.json").write_text(json.dumps(raw))
    config, _ = load_peft(path)
    assert (config.use_rslora, config.scaling, config.base_model_name_or_path) == (False, 2.0, "")


def test_a_rank_one_adapter_round_trips_into_nested_new_directories(tmp_path):
    path = _ours(tmp_path / "runs" / "r1" / "sampler_weights", rank=1)
    config, weights = load_peft(path)
    assert (config.rank, config.scaling, config.base_model_name_or_path) == (1, 4.0, "org/base")
    assert all(a.shape[1] == 1 and b.shape[0] == 1 for a, b in weights.values())
    with pytest.raises(ValueError, match="rank must be >= 1"):
        AdapterConfig(rank=0, alpha=4.0, target_modules=("q_proj",), base_model_name_or_path="m")


@pytest.mark.parametrize(
    "a_shape, b_shape", [((8, 2), (3, 8)), ((8, 1), (1, 8)), ((8, 2, 1), (2, 8)), ((8, 2), (2, 8, 1))]
)
def test_save_refuses_pairs_that_are_not_in_r_and_r_out(a_shape, b_shape):
    config = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj",), base_model_name_or_path="m")
    pair = (np.ones(a_shape, np.float32), np.ones(b_shape, np.float32))
    with pytest.raises(ValueError, match=r"are not \[in, R\] and \[R, out\] with R >= 2"):
        save_peft("/nonexistent", config, {"model.layers.0.self_attn.q_proj": pair})


@pytest.mark.parametrize(
    "rename, message",
    [
        (lambda k: k.replace("q_proj.lora_A.weight", "q_proj.lora_A.other.weight"), "several adapters"),
        (lambda k: k.replace("v_proj.lora_B.weight", "v_proj.lora_B.bias"), "LoRA biases"),
        (lambda k: k.replace("v_proj.lora_A.weight", "v_proj.lora_A.bias"), "LoRA biases"),
    ],
)
def test_files_with_tensors_we_cannot_serve_are_refused(tmp_path, rename, message):
    path = _ours(tmp_path)
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    save_file({rename(k): v for k, v in tensors.items()}, str(file))
    with pytest.raises(ValueError, match=message):
        load_peft(path)


def test_full_embedding_copies_peft_saves_beside_the_adapter_are_skipped(base, tmp_path):
    model = make_peft(base, target_modules=["q_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "a", save_embedding_layers=True)  # full embed_tokens and lm_head copies
    config, weights = load_peft(tmp_path / "a")
    assert config.target_modules == ("q_proj",) and sorted(weights) == [
        f"model.layers.{i}.self_attn.q_proj" for i in range(2)
    ]
