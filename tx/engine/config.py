"""`EngineConfig`: every engine knob in one frozen value, built once from the CLI (`tx.api.__main__`).

Sections follow the owners: `adapters` (the adapter bank: device slots, rank, runs per server),
`trainer` (micro-batches, rematerialisation) and `sampler` (`SamplerConfig`; its sequence length is cut to
the model's and its cache form set from the backend's `Tuning` when the runner is built).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tx.engine.sampler import SamplerConfig


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    max_lora_adapters: int = 8  # device slots (the slot axis holds one more: slot 0, the base model)
    max_lora_rank: int = 128  # the largest rank a run may ask for; the stacks follow the ranks in use
    max_runs: int = 256  # training runs per server, on the device or paged out to host memory

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-lora-adapters", self.max_lora_adapters),
            ("--max-lora-rank", self.max_lora_rank),
            ("--max-runs", self.max_runs),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    micro_batch_tokens: int = 8192  # tokens per training micro-batch; bounds activation memory
    remat: bool = False  # recompute each layer's activations in the backward pass

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"--train-micro-batch-tokens must be >= 1, got {self.micro_batch_tokens}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    data_dir: Path
    base_model: str = ""  # the name the model is served under (hub name or directory); set per model
    dtype: str | None = None  # "auto", "bfloat16", "float32", or None for the checkpoint's own
    tensor_parallel_size: int = 1
    fsdp_size: int = 1
    expert_parallel_size: int = 1  # devices a MoE block's experts (and batch rows) are split over
    adapters: AdapterConfig = AdapterConfig()
    trainer: TrainerConfig = TrainerConfig()
    sampler: SamplerConfig = SamplerConfig(max_seq_len=4096)

    @property
    def max_seq_len(self) -> int:
        """The longest training or sampling sequence asked for (cut to the model's own limit at build)."""
        return self.sampler.max_seq_len
