"""The engine: planner, runner loop, jitted train/sample steps, losses, batching, checkpoints."""

from tx.engine.build import build_runner

__all__ = ["build_runner"]
