"""Many tenants on few adapter slots: N LoRA runs doing RL steps on a server with 4 device slots; one JSON
object per N on stdout.

One RL step of a run: save sampler weights (an ephemeral snapshot), sample `--samples` continuations of
one prompt, forward_backward (importance_sampling) on them, optim_step: each request waits for the previous
one of its run, and every run keeps one request in flight, as N concurrent RL scripts would. Each N runs
twice, the first time unreported: it compiles the batch shapes (adapter count, rows, widths) N tenants
make. The runner is the real `JaxRunner` (built by `build_runner`), driven as the engine thread drives it,
so runs beyond the
slots are paged to host memory and back. Reported per N: steps/s in total and per run (steady state, after
each run's first step), page-in and page-out counts and seconds, p99 queue wait of the training requests
after each run's first step,
and `vs_fewest`: total steps/s relative to the smallest N (target: 16 runs on 4 slots >= 0.8 of 4 on 4).

    python benchmarks/tenants.py                       # tiny model, N = 4 16 64: 24, 6 and 4 steps each
    python benchmarks/tenants.py --base-model /tmp/models/small --runs 4 16
    python benchmarks/tenants.py --quick               # CI smoke: N = 2 4 on 2 slots, 2 steps
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _build(base_model: str | None, slots: int, data_dir: Path) -> Any:
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig
    from tx.models.tiny import write_tiny_model

    model = base_model or str(write_tiny_model(data_dir / "tiny"))
    config = EngineConfig(
        data_dir=data_dir, base_model=model, adapters=AdapterConfig(slots, 8, max_runs=1024),
        sampler=SamplerConfig(max_rows=64, max_seq_len=256),
    )  # fmt: skip
    runner, _ = build_runner(config)
    return runner


class Tenant:
    """One RL script: its run id, the step it is in, the request in flight and what its steps produced."""

    KINDS = ("save_weights_for_sampler", "sample", "forward_backward", "optim_step")

    def __init__(self, name: str, samples: int, max_tokens: int) -> None:
        self.name, self.samples, self.max_tokens = name, samples, max_tokens
        self.phase, self.steps = -1, 0
        self.step_times: list[float] = []
        self.sequences: list[list[int]] = []
        self.prompt = [1, 2, 3, 4, 5, 6, 7, 8]

    def next_item(self, ids: Any) -> Any:
        from tx.protocol import (
            AdamParams,
            CreateModelRequest,
            Datum,
            ForwardBackwardRequest,
            LoraConfig,
            OptimStepRequest,
            SampleRequest,
            SamplingParams,
            SaveSamplerRequest,
            WeightsRef,
            WorkItem,
        )

        kind = "create_model" if self.phase < 0 else self.KINDS[self.phase % 4]
        snapshot = f"{self.name}-snap"
        if kind == "create_model":
            payload: Any = CreateModelRequest("m", LoraConfig(8, 32.0, seed=len(self.name)))
        elif kind == "save_weights_for_sampler":
            payload = SaveSamplerRequest(snapshot)
        elif kind == "sample":
            params = SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=self.steps)
            payload = SampleRequest(self.prompt, self.samples, params, "m", weights=WeightsRef(snapshot))
        elif kind == "forward_backward":
            payload = ForwardBackwardRequest([self._datum(s, Datum) for s in self.sequences], "importance_sampling")
        else:
            payload = OptimStepRequest(AdamParams(learning_rate=1e-3))
        return WorkItem(f"t{next(ids)}", kind, self.name, payload, time.time())  # type: ignore[arg-type]

    def _datum(self, seq: list[int], datum_type: Any) -> Any:
        tokens = self.prompt + seq
        n = len(tokens) - 1
        reward = float(np.mean(np.asarray(seq) % 2 == 0)) - 0.5  # toy reward: even token ids
        inputs = {
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "logprobs": np.full(n, -3.0, np.float32),
            "advantages": np.full(n, reward, np.float32),
        }
        return datum_type(tokens[:-1], inputs)

    def done(self, result: Any, now: float) -> None:
        kind = "create_model" if self.phase < 0 else self.KINDS[self.phase % 4]
        if kind == "sample":
            self.sequences = [list(s.tokens) for s in result.sequences]
        if kind == "optim_step":
            self.steps += 1
            self.step_times.append(now)
        self.phase += 1


def measure(runner: Any, runs: int, steps: int, samples: int, max_tokens: int) -> dict[str, Any]:
    """Drive `runs` tenants for `steps` RL steps each; the figures of one N."""
    import itertools

    from tx.protocol import RequestError

    ids = itertools.count()
    tenants = [Tenant(f"run{runs}-{i}", samples, max_tokens) for i in range(runs)]
    owner: dict[str, Tenant] = {}
    waits: list[float] = []
    before = (runner.pager.stats.page_ins, runner.pager.stats.page_outs, runner.pager.stats.seconds)

    def submit(tenant: Tenant) -> None:
        item = tenant.next_item(ids)
        owner[item.future_id] = tenant
        runner.submit([item])

    for tenant in tenants:
        submit(tenant)
    while owner:
        for completion in runner.step():
            tenant = owner.pop(completion.future_id)
            if isinstance(completion.result, RequestError):
                raise RuntimeError(f"{tenant.name}: {completion.result}")
            if tenant.steps >= 1 and hasattr(completion.result, "metrics"):  # steady state: after the first step
                waits.append(completion.result.metrics["queue_wait_s:max"])
            tenant.done(completion.result, time.perf_counter())
            if tenant.steps < steps:
                submit(tenant)
    per_run = [(len(t.step_times) - 1) / (t.step_times[-1] - t.step_times[0]) for t in tenants if len(t.step_times) > 1]
    first = min(t.step_times[0] for t in tenants)
    last = max(t.step_times[-1] for t in tenants)
    steady = sum(len(t.step_times) - 1 for t in tenants)
    stats = runner.pager.stats
    return {
        "runs": runs,
        "slots": runner.slots.max_adapters,
        "steps_per_run": steps,
        "steps_per_s_total": steady / (last - first) if last > first else None,
        "steps_per_s_per_run_mean": float(np.mean(per_run)) if per_run else None,
        "page_ins": stats.page_ins - before[0],
        "page_outs": stats.page_outs - before[1],
        "page_seconds": round(stats.seconds - before[2], 4),
        "queue_wait_p99_s": float(np.percentile(waits, 99)) if waits else None,
        "host_bytes_per_run": int(np.mean([h.nbytes for h in runner.bank.host.values()])) if runner.bank.host else 0,
    }


def unload(runner: Any, runs: int) -> None:
    from tx.protocol import UnloadModelRequest, WorkItem

    items = [WorkItem(f"u{runs}-{i}", "unload_model", f"run{runs}-{i}", UnloadModelRequest(), 0.0) for i in range(runs)]
    runner.submit(items)  # type: ignore[arg-type]
    while not runner.idle():
        runner.step()
    for info in [info for info in runner.slots if info.kind == "sampler"]:  # the runs' snapshots go too
        runner.bank.clear(runner.bank.release(info.owner).slot)
    runner.bank.host_snapshots.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default=None, help="model directory (default: the tiny offline Qwen3)")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--runs", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--steps", type=int, default=4, help="RL steps per run at least (the first is not timed)")
    p.add_argument("--total-steps", type=int, default=96, help="RL steps of all runs together at least (a few runs "
                   "take more steps each, so every N is timed over a window of similar length)")  # fmt: skip
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="CI smoke: N = 2 4 on 2 slots, 2 steps")
    args = p.parse_args()
    if args.quick:
        args.slots, args.runs, args.steps, args.total_steps, args.samples, args.max_tokens = 2, [2, 4], 2, 0, 2, 4
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        runner = _build(args.base_model, args.slots, Path(tmp))
        fewest = None
        for runs in args.runs:
            steps = max(args.steps, -(-args.total_steps // runs))
            measure(runner, runs, steps, args.samples, args.max_tokens)  # compiles this N's batch shapes: unreported
            unload(runner, runs)
            row = measure(runner, runs, steps, args.samples, args.max_tokens)
            unload(runner, runs)
            fewest = fewest or row["steps_per_s_total"]
            total = row["steps_per_s_total"]
            row["vs_fewest"] = round(total / fewest, 3) if total and fewest else None
            row["backend"] = jax.default_backend()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
