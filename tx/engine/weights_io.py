"""Moving adapter slots to and from disk (PEFT format), and the full fine-tuning memory check.

The trainer keeps LoRA weights as plain arrays; the slot functions of `tx.lora.adapters` want the
typed nnx view (they read the logical axes), so this module rebuilds that view around the current
arrays and hands the updated arrays back to the trainer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
from flax import nnx
from jax.sharding import Mesh

from tx.engine.trainer import Trainer, lora_targets
from tx.lora import adapters, peft
from tx.models.config import ModelConfig
from tx.models.weights import load_model, save_hf
from tx.protocol import LoraConfig


class WeightsIO:
    def __init__(self, lora_template: nnx.State, base_model: str, model_dir: Path, mesh: Mesh | None = None) -> None:
        self.template = list(nnx.to_flat_state(lora_template))
        self.base_model = base_model
        self.model_dir = model_dir
        self.mesh = mesh

    def _view(self, trainer: Trainer) -> nnx.State:
        pairs = []
        for path, var in self.template:
            key = tuple(str(k) for k in path)
            pairs.append((path, var.replace(trainer.lora[key])))
        return nnx.from_flat_state(pairs)

    def _take_back(self, trainer: Trainer, state: nnx.State) -> None:
        for path, var in nnx.to_flat_state(state):
            trainer.lora[tuple(str(k) for k in path)] = var.get_value()

    def save_peft(self, dest: Path, trainer: Trainer, slot: int, lora: LoraConfig) -> int:
        targets = lora_targets(lora)
        weights = adapters.read_slot(self._view(trainer), slot, lora.rank, targets)
        config = peft.AdapterConfig(lora.rank, lora.alpha, tuple(sorted(targets)), self.base_model)
        peft.save_peft(dest, config, weights)
        return sum(f.stat().st_size for f in dest.iterdir() if f.is_file())

    def peft_lora_config(self, source: Path) -> LoraConfig:
        config, _ = peft.load_peft(source)
        t = set(config.target_modules)
        return LoraConfig(
            rank=config.rank,
            alpha=config.alpha,
            train_attn=bool(t & {"q_proj", "k_proj", "v_proj", "o_proj"}),
            train_mlp=bool(t & {"gate_proj", "up_proj", "down_proj"}),
            train_unembed="lm_head" in t,
        )

    def load_peft(self, source: Path, trainer: Trainer, slot: int) -> None:
        config, weights = peft.load_peft(source)
        state = adapters.write_slot(self._view(trainer), slot, config, weights)
        self._take_back(trainer, state)
        trainer.scale[slot] = np.where(np.arange(trainer.max_rank) < config.rank, config.scaling, 0.0)

    def save_full(self, dest: Path, weights: dict, cfg: ModelConfig) -> int:
        return save_hf(weights, cfg, self.model_dir, dest)

    @staticmethod
    def is_full(source: Path) -> bool:
        return (source / "config.json").is_file() and not (source / peft.CONFIG_NAME).is_file()

    def load_full(self, source: Path) -> dict:
        model, _ = load_model(str(source), mesh=self.mesh, progress=False)
        _, base = nnx.split(model, nnx.Param)  # a full checkpoint has no adapter slots
        return {tuple(str(k) for k in p): v.get_value() for p, v in nnx.to_flat_state(base)}

    @staticmethod
    def check_full_finetune_fits(trainer: Trainer) -> None:
        """Refuse full fine-tuning when weights + fp32 gradients + Adam moments exceed free memory."""
        params = sum(int(np.prod(v.shape)) for v in trainer.base.values())
        need = params * (trainer.base[next(iter(trainer.base))].dtype.itemsize + 4 * 3)
        free = psutil.virtual_memory().available
        if need > 0.9 * free:
            raise MemoryError(
                f"full fine-tuning needs about {need / 2**30:.1f} GiB (weights copy, fp32 gradients, Adam moments "
                f"for {params / 1e6:.0f}M parameters) but only {free / 2**30:.1f} GiB is free; use LoRA instead"
            )
