"""What a rank-8 run costs under --max-lora-rank 32 and under 128: step time and device bytes, one JSON object.

Two real `JaxRunner`s over one base model (built by `build_runner`), one with `--max-lora-rank 32`, one with
128, each holding one rank-8 LoRA run. One step is a forward_backward of `--batch` sequences of `--length`
tokens and an optim_step. The servers alternate step by step in this one process (A B B A ...), so load
from other processes falls on both alike; each server's first steps compile and are not timed. Reported:
the median step time per server and their ratio (target: within 5%), the model's device bytes
(`JaxRunner.resident_bytes`: base weights, adapter stacks, the run's optimizer state) and the adapter
stacks' bytes and rank width per server, the load average, and the machine.

    python benchmarks/ranks.py                        # tiny offline model, 20 timed steps per server
    python benchmarks/ranks.py --base-model /tmp/models/small --steps 10
    python benchmarks/ranks.py --quick                # CI smoke: 2 timed steps
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_all import machine  # noqa: E402

_ids = itertools.count()


def _build(model: str, max_rank: int, slots: int, data_dir: Path) -> Any:
    from tx.engine import AdapterConfig, EngineConfig, build_runner

    config = EngineConfig(data_dir=data_dir, base_model=model, adapters=AdapterConfig(slots, max_rank))
    return build_runner(config)[0]


def _run(runner: Any, kind: str, payload: Any) -> Any:
    """Submit one item for the run "r8" and step the runner until it completes."""
    from tx.protocol import RequestError, WorkItem

    item = WorkItem(f"b{next(_ids)}", kind, "r8", payload, created_at=time.time())  # type: ignore[arg-type]
    runner.submit([item])
    while True:
        for completion in runner.step():
            if isinstance(completion.result, RequestError):
                raise RuntimeError(f"{kind} failed: {completion.result}")
            return completion.result


def _step_requests(batch: int, length: int, vocab: int) -> tuple[Any, Any]:
    from tx.protocol import AdamParams, Datum, ForwardBackwardRequest, OptimStepRequest

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (batch, length + 1))
    data = [Datum(row[:-1].tolist(), {"target_tokens": row[1:].astype(np.int64)}) for row in tokens]
    return ForwardBackwardRequest(data, "cross_entropy"), OptimStepRequest(AdamParams(learning_rate=1e-4))


def _timed_step(runner: Any, requests: tuple[Any, Any]) -> float:
    start = time.perf_counter()
    _run(runner, "forward_backward", requests[0])
    _run(runner, "optim_step", requests[1])
    return time.perf_counter() - start


def measure(model: str, steps: int, batch: int, length: int, slots: int, data_dir: Path) -> dict[str, Any]:
    from tx.protocol import CreateModelRequest, LoraConfig

    servers = {rank: _build(model, rank, slots, data_dir / f"max{rank}") for rank in (32, 128)}
    vocab = min(int(servers[32].trainer.config.vocab_size), 1000)
    requests = _step_requests(batch, length, vocab)
    for runner in servers.values():
        _run(runner, "create_model", CreateModelRequest("m", LoraConfig(8, 32.0, seed=1)))
        for _ in range(2):  # compiles
            _timed_step(runner, requests)
    times: dict[int, list[float]] = {32: [], 128: []}
    for i in range(steps):
        for rank in (32, 128) if i % 2 == 0 else (128, 32):
            times[rank].append(_timed_step(servers[rank], requests))
    median = {rank: statistics.median(t) for rank, t in times.items()}
    per_server = {
        f"max_rank_{rank}": {
            "step_s_median": round(median[rank], 5),
            "step_s_min": round(min(times[rank]), 5),
            "device_bytes": int(runner.resident_bytes()),
            "adapter_stack_bytes": int(runner.bank.device_bytes()),
            "adapter_stack_rank": int(runner.bank.stack_rank),
        }
        for rank, runner in servers.items()
    }
    return {
        "benchmark": "ranks",
        "run_rank": 8,
        "steps_per_server": steps,
        "batch": batch,
        "length": length,
        "slots": slots,
        **per_server,
        "step_time_ratio_128_vs_32": round(median[128] / median[32], 4),
        "device_bytes_ratio_128_vs_32": round(
            per_server["max_rank_128"]["device_bytes"] / per_server["max_rank_32"]["device_bytes"], 4
        ),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default=None, help="model directory (default: the tiny offline Qwen3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per server (after 2 untimed ones)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--slots", type=int, default=8, help="--max-lora-adapters of both servers")
    p.add_argument("--quick", action="store_true", help="CI smoke: 2 timed steps of 2 x 32 tokens")
    args = p.parse_args()
    if args.quick:
        args.steps, args.batch, args.length = 2, 2, 32
    import jax

    from tx.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.base_model or str(write_tiny_model(Path(tmp) / "tiny"))
        row = measure(model, args.steps, args.batch, args.length, args.slots, Path(tmp))
    row["backend"] = jax.default_backend()
    row["machine"] = machine()
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
