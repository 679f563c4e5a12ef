"""Moving adapter slots to and from disk (PEFT format), full weight sets too, and the full fine-tuning
memory check. Adapter slots are read and written through the model's `AdapterBank`.

PEFT module names are the text model's (`model.layers.N.<module>`, what `AutoModelForCausalLM` builds from
either Qwen3.5 checkpoint class), numbered by model layer; adapters named for the multimodal class
(`model.language_model.layers.N...`) load too. Over several processes every process gathers an export's
arrays and process 0 alone writes the files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError

from tx.engine.bank import AdapterBank
from tx.engine.cache_budget import free_bytes
from tx.engine.errors import check_finite, damaged_checkpoint
from tx.engine.trainer import Trainer, lora_targets
from tx.gather import is_writer
from tx.lora import peft
from tx.lora.targets import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGETS
from tx.models.causal_lm import decode_layout
from tx.models.config import ModelConfig
from tx.models.safetensors_io import BadSafetensors
from tx.models.weights import load_model, save_hf, text_module_name
from tx.protocol import LoraConfig
from tx.tuning import Tuning

# Families whose PEFT export writes the experts fused (`target_parameters`): the pinned peft converts a
# per-expert adapter onto transformers 5's fused experts for Qwen3-MoE, but for Qwen3.5-MoE it has no such
# conversion and would silently drop the expert adapters; gpt-oss's experts were only ever fused parameters.
FUSED_EXPERT_FAMILIES = frozenset({"qwen3_5_moe", "gpt_oss"})


class WeightsIO:
    """`tuning`: the backend choices weight sets are laid out for the sampler with (`decode_layout`)."""

    def __init__(
        self, base_model: str, model_dir: Path, cfg: ModelConfig, tuning: Tuning, mesh: Mesh | None = None
    ) -> None:
        self.base_model = base_model
        self.model_dir = model_dir
        self.cfg = cfg
        self.mesh = mesh
        self.tuning = tuning

    def save_peft(self, dest: Path, bank: AdapterBank, slot: int, lora: LoraConfig) -> int:
        targets = lora_targets(lora) & bank.targets()  # the flags' names this model has
        weights = bank.read_peft(slot, lora.rank, targets, self.cfg.stacked_layer)  # gathered on every process
        if not is_writer():
            return 0
        config = peft.AdapterConfig(lora.rank, lora.alpha, tuple(sorted(targets)), self.base_model)
        peft.save_peft(dest, config, weights, fused_experts=self.cfg.family in FUSED_EXPERT_FAMILIES)
        return sum(f.stat().st_size for f in dest.iterdir() if f.is_file())

    def read_peft(self, source: Path) -> tuple[peft.AdapterConfig, peft.AdapterWeights]:
        """A sampler checkpoint's adapter, checked (readable, finite); `write_peft` puts it in a slot."""
        try:
            config, weights = peft.load_peft(source, fused_gate_up=self.cfg.family == "gpt_oss")
        except DAMAGED as exc:
            raise damaged_checkpoint("sampler checkpoint", source, "files", exc) from exc
        check_finite("sampler checkpoint", source, [x for pair in weights.values() for x in pair])
        return config, weights

    def peft_lora_config(self, source: Path) -> LoraConfig:
        return self.lora_config_of(self.read_peft(source)[0])

    @staticmethod
    def lora_config_of(config: peft.AdapterConfig) -> LoraConfig:
        t = set(config.target_modules)
        return LoraConfig(
            rank=config.rank,
            alpha=config.alpha,
            train_attn=bool(t & ATTN_TARGETS),
            train_mlp=bool(t & MLP_TARGETS),
            train_unembed=bool(t & UNEMBED_TARGETS),
        )

    def load_peft(self, source: Path, bank: AdapterBank, slot: int) -> None:
        self.write_peft(self.read_peft(source), bank, slot)

    def write_peft(self, adapter: tuple[peft.AdapterConfig, peft.AdapterWeights], bank: AdapterBank, slot: int) -> None:
        config, weights = adapter
        weights = {text_module_name(name, self.cfg): pair for name, pair in weights.items()}
        bank.write_peft(slot, config, weights, self.cfg.stacked_layer)

    def save_full(self, dest: Path, weights: dict, cfg: ModelConfig) -> int:
        return save_hf(weights, cfg, self.model_dir, dest)

    @staticmethod
    def is_full(source: Path) -> bool:
        return (source / "config.json").is_file() and not (source / peft.CONFIG_NAME).is_file()

    def load_full(self, source: Path) -> dict:
        try:
            model, _ = load_model(str(source), mesh=self.mesh, progress=False, tuning=self.tuning)
        except DAMAGED as exc:
            raise damaged_checkpoint("sampler checkpoint", source, "files", exc) from exc
        _, base = nnx.split(model, nnx.Param)  # a full checkpoint has no adapter slots
        flat = {tuple(str(k) for k in p): v.get_value() for p, v in nnx.to_flat_state(base)}
        return decode_layout(flat, self.tuning)

    @staticmethod
    def check_full_finetune_fits(trainer: Trainer) -> None:
        """Refuse full fine-tuning when weights + fp32 gradients + Adam moments exceed free memory (the
        accelerators' own memory where they report it, else the host's)."""
        params = sum(int(np.prod(v.shape)) for v in trainer.base.values())
        need = params * (trainer.base[next(iter(trainer.base))].dtype.itemsize + 4 * 3)
        free = free_bytes(next(iter(trainer.base.values())).sharding.device_set)
        if need > 0.9 * free:
            raise MemoryError(
                f"full fine-tuning needs about {need / 2**30:.1f} GiB (weights copy, fp32 gradients, Adam moments "
                f"for {params / 1e6:.0f}M parameters) but only {free / 2**30:.1f} GiB is free; use LoRA instead"
            )


# What reading a truncated or garbled weights file raises (our own checks name their fields instead).
DAMAGED = (SafetensorError, BadSafetensors, json.JSONDecodeError, UnicodeDecodeError)
