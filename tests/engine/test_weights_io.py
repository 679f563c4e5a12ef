"""WeightsIO's checks that need no engine: the full fine-tuning memory check (the accelerators' own free
memory, the host's only on CPU), which directories are full checkpoints, and a PEFT adapter's LoraConfig; and
the base model an exported adapter names."""

import json
from pathlib import Path

import jax.numpy as jnp
import psutil
import pytest
from drive import run, tiny_runner

from tx.engine import weights_io
from tx.engine.weights_io import WeightsIO, free_bytes
from tx.models.config import ModelConfig
from tx.protocol import CreateModelRequest, CreateModelResult, LoraConfig, SaveSamplerRequest
from tx.tuning import CPU


class FakeDevice:
    def __init__(self, stats: dict | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict | None:
        return self.stats


def test_accelerator_memory_is_what_its_allocator_reports():
    gpus = {FakeDevice({"bytes_limit": 100 << 30, "bytes_in_use": 30 << 30}), FakeDevice({"bytes_limit": 10 << 30})}
    assert free_bytes(gpus) == (70 << 30) + (10 << 30)  # type: ignore[arg-type]


def test_devices_without_stats_fall_back_to_host_memory():
    host = psutil.virtual_memory().available
    assert abs(free_bytes({FakeDevice(None)}) - host) < 1 << 30  # type: ignore[arg-type]


class Weights:
    """What check_full_finetune_fits reads of a trainer: its base weights."""

    def __init__(self, **arrays: jnp.ndarray) -> None:
        self.base = {(name,): value for name, value in arrays.items()}


@pytest.mark.parametrize("dtype, itemsize", [(jnp.float32, 4), (jnp.bfloat16, 2)])
def test_full_finetuning_needs_the_weights_copy_and_three_fp32_buffers_within_90_percent(monkeypatch, dtype, itemsize):
    params = 1000 + 125  # two tensors
    trainer = Weights(a=jnp.zeros((10, 100), dtype), b=jnp.zeros((125,), dtype))
    need = params * (itemsize + 3 * 4)  # weights copy + fp32 gradients + two fp32 Adam moments
    assert need == 0.9 * (need / 0.9)
    monkeypatch.setattr(weights_io, "free_bytes", lambda devices: need / 0.9)
    WeightsIO.check_full_finetune_fits(trainer)  # type: ignore[arg-type]  # exactly at the limit: fits
    monkeypatch.setattr(weights_io, "free_bytes", lambda devices: (need - 1) / 0.9)
    with pytest.raises(MemoryError, match="use LoRA instead"):
        WeightsIO.check_full_finetune_fits(trainer)  # type: ignore[arg-type]


def test_a_full_checkpoint_has_a_model_config_and_no_adapter_config(tmp_path: Path):
    def directory(name: str, *files: str) -> Path:
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("{}")
        return tmp_path / name

    assert WeightsIO.is_full(directory("hf", "config.json", "model.safetensors"))
    assert not WeightsIO.is_full(directory("peft", "adapter_config.json", "adapter_model.safetensors"))
    assert not WeightsIO.is_full(directory("both", "config.json", "adapter_config.json"))
    assert not WeightsIO.is_full(directory("empty"))


@pytest.mark.parametrize(
    "targets, flags",
    [
        (["q_proj", "v_proj", "lm_head"], (True, False, True)),
        (["gate_proj", "down_proj"], (False, True, False)),
        (["o_proj", "up_proj"], (True, True, False)),
    ],
)
def test_a_peft_adapter_saved_by_peft_gives_its_lora_config(tmp_path: Path, targets: list[str], flags: tuple):
    import peft
    from conftest import TINY
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_config = Qwen3Config(**TINY, num_key_value_heads=2)
    model = Qwen3ForCausalLM(hf_config)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    peft.get_peft_model(model, config).save_pretrained(tmp_path)
    train_attn, train_mlp, train_unembed = flags
    cfg = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    got = WeightsIO("m", tmp_path, cfg, CPU).peft_lora_config(tmp_path)
    assert got == LoraConfig(rank=4, alpha=8.0, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)


def test_an_adapter_of_a_model_named_by_a_relative_path_names_its_base_by_the_absolute_one(
    hf_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--base-model ./model`: the exported adapter's `base_model_name_or_path` is read later from another
    working directory (`tx.merge`, `peft`), where `./model` is nothing."""
    model_dir = hf_models()[0]
    monkeypatch.chdir(model_dir.parent.parent)  # named `parent/model/`, as shell completion writes it
    runner = tiny_runner(Path(model_dir.parent.name, model_dir.name, ""), tmp_path / "data", slots=2)
    assert isinstance(
        run(runner, "create_model", "r", CreateModelRequest(model_dir.name, LoraConfig(2))), CreateModelResult
    )
    dest = tmp_path / "data" / "checkpoints" / "r" / "sampler_weights" / "s"
    save = SaveSamplerRequest("s", name="s", dest_dir=str(dest), tinker_path="tinker://r/sampler_weights/s")
    run(runner, "save_weights_for_sampler", "r", save)
    written = json.loads((dest / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(model_dir.absolute())
