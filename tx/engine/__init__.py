"""The engine: planner, runner loop, jitted train/sample steps, losses, batching, checkpoints."""

from tx.engine.build import build_runner
from tx.engine.config import AdapterConfig, EngineConfig, TrainerConfig

__all__ = ["AdapterConfig", "EngineConfig", "TrainerConfig", "build_runner"]
