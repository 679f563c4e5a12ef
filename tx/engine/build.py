"""Builds the JAX runner for one base model from one `EngineConfig`: load the model, then its adapter bank,
the trainer, the sampler and the runner."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

from tx.engine.bank import AdapterBank
from tx.engine.compiles import enable_persistent_cache, install_counter
from tx.engine.config import EngineConfig
from tx.engine.run_memory import RunMemory
from tx.engine.runner import JaxRunner
from tx.engine.sampler import Sampler
from tx.engine.text import load_decoder
from tx.engine.trainer import Trainer
from tx.engine.weights_io import WeightsIO
from tx.lora.layers import LoRASpec
from tx.lora.params import LoRAParam
from tx.lora.select import rank_bucket
from tx.models.catalog import (
    DTYPE_BYTES,
    describe_model,
    exported_base_name,
    has_weights,
    locate_model,
    weight_bytes,
)
from tx.models.causal_lm import decode_layout
from tx.models.checkpoint_check import check_checkpoint, expected_weights
from tx.models.config import HYBRID_FAMILIES, ModelConfig, load_hf_config
from tx.models.sharding import make_mesh
from tx.models.weights import abstract_for, load_model
from tx.protocol import ModelInfo
from tx.tuning import Tuning, for_backend, tuned_for

log = logging.getLogger("tx.engine")


def resolve_dtype(dtype: str | None, tuning: Tuning) -> str | None:
    """ "auto" -> the backend's `Tuning.auto_dtype` (bfloat16 on an accelerator, float32 on CPU, which has no
    bf16 arithmetic); None keeps the checkpoint's own dtype; anything else as given."""
    return tuning.auto_dtype if dtype == "auto" else dtype


def estimate_bytes(model_dir: Path, dtype: str | None, adapter_slots: int = 8) -> int:
    """Device bytes a model will take before it is loaded: its weights in the dtype they load in, twice
    where the sampler keeps its own per-layer copy (`Tuning.per_layer_decode`, CPU), and its adapter bank as
    built (`adapter_slots` + 1 slots at the smallest rank bucket). A directory with only its `config.json` (a
    hub model not downloaded yet) is sized from the config."""
    tuning = for_backend()
    loaded = resolve_dtype(dtype, tuning)
    weights = weight_bytes(model_dir, loaded) if has_weights(model_dir) else config_weight_bytes(model_dir, loaded)
    bank = bank_bytes(load_hf_config(model_dir, loaded), adapter_slots)
    return weights * (2 if tuning.per_layer_decode else 1) + bank


def bank_bytes(cfg: ModelConfig, adapter_slots: int) -> int:
    """The adapter stacks' bytes as `build_runner` makes them (shapes only, nothing allocated). A model with a
    tiny hidden size and a huge vocabulary or MLP has a bank ~100x its weights: a 21 MB upload built a
    1.2 GB bank, and one of 0.4 GB would have built 59 GB, past a budget that counted the weights alone."""
    lora = LoRASpec(adapter_slots + 1, rank_bucket(1, 1 << 30))
    stacks = nnx.to_flat_state(nnx.state(abstract_for(cfg, lora, False), LoRAParam))
    return sum(math.prod(var.get_value().shape) * var.get_value().dtype.itemsize for _, var in stacks)


def config_weight_bytes(model_dir: Path, dtype: str | None) -> int:
    """The text model's weight bytes from its `config.json` alone: the parameter count of the abstract model
    (shapes only) in `dtype`, or in the config's own dtype when None."""
    cfg = load_hf_config(model_dir, dtype)
    count: int = sum(math.prod(var.get_value().shape) for var in expected_weights(cfg).values())
    return count * DTYPE_BYTES[cfg.dtype]


def machine_tuning(cfg: ModelConfig, max_rows: int, store: Path | None = None) -> Tuning:
    """The backend's tuning with the choices it leaves to this machine measured for this model's width and
    `max_rows` decode rows (`tx.tuning.tuned_for`; the answers are kept in `store`, a JSON file). The
    hybrid families have no backend-specific forms yet: nothing to measure for them."""
    if cfg.family in HYBRID_FAMILIES:
        return for_backend()
    return tuned_for(for_backend(), cfg.hidden_size, cfg.intermediate_size, cfg.dtype, max_rows, store)


def build_runner(
    config: EngineConfig, model_dir: Path | None = None, run_memory: RunMemory | None = None
) -> tuple[JaxRunner, ModelInfo]:
    """`config.base_model` is the name the model is served under; `model_dir` its files when the caller has
    located them already (default: `locate_model(config.base_model)`); `run_memory` the bytes of the
    server's LoRA runs, shared by its models (default: this model's own, at the default limit)."""
    install_counter()
    enable_persistent_cache(Path(config.data_dir) / "compile-cache")
    model_dir = model_dir or locate_model(config.base_model)
    # Headers against the config before anything is sized by it: a small repo whose config claims a huge
    # model passed the budget (sized from the files) and then allocated at the config's shapes.
    check_checkpoint(model_dir)
    dtype = resolve_dtype(config.dtype, for_backend())
    store = Path(config.data_dir) / "tuning.json"
    tuning = machine_tuning(load_hf_config(model_dir, dtype), config.sampler.max_rows, store)
    adapters = config.adapters
    mesh = make_mesh(1, config.fsdp_size, config.tensor_parallel_size, expert=config.expert_parallel_size)
    where = f"{mesh.devices.size} {mesh.devices.flat[0].platform} device{'s' if mesh.devices.size > 1 else ''}"
    log.info("loading %s (%s) on %s", model_dir, dtype or "checkpoint dtype", where)  # "1 cpu device": no GPU jax
    # Slot 0 is the base model. The stacks start at the smallest rank bucket: the bank widens them to the
    # ranks of the adapters it holds (up to --max-lora-rank), so no array is ever allocated at the limit.
    width = rank_bucket(1, adapters.max_lora_rank)
    lora = LoRASpec(adapters.max_lora_adapters + 1, width, tuning.lora_kernel)
    model, cfg = load_model(
        str(model_dir), dtype=dtype, lora=lora, mesh=mesh, remat=config.trainer.remat, tuning=tuning
    )
    bank = AdapterBank.of(model, adapters.max_runs, adapters.max_lora_rank, run_memory)
    trainer = Trainer(model, bank, config.trainer.micro_batch_tokens)
    decode, eos = load_decoder(model_dir)
    seq_len = min(config.max_seq_len, cfg.max_position_embeddings)
    sampler_cfg = dataclasses.replace(config.sampler, max_seq_len=seq_len, layer_cache=tuning.per_layer_decode)

    def make_sampler(get_base: Callable[[], dict], programs: Any = None) -> Sampler:
        def state() -> dict:
            return {**get_base(), **bank.arrays}

        return Sampler(trainer.steps.graphdef, state, cfg, sampler_cfg, eos, decode, bank, programs)

    # The frozen base as the sampler reads it (on CPU a per-layer copy: +1x the base weights; elsewhere the
    # trainer's own buffers).
    decode_base = decode_layout(trainer.base, tuning)
    sampler = make_sampler(lambda: decode_base)
    io = WeightsIO(exported_base_name(config.base_model, model_dir), model_dir, cfg, tuning, mesh)
    runner = JaxRunner(
        trainer, sampler, io, config.base_model, lambda get_base: make_sampler(get_base, sampler.programs),
        checkpoint_root=Path(config.data_dir).resolve() / "checkpoints",
    )  # fmt: skip
    info = describe_model(
        config.base_model, model_dir, config.max_seq_len, adapters.max_lora_rank, adapters.max_lora_adapters
    )
    return runner, info
