"""One engine on 1 process x 4 devices against 2 processes x 2 devices (JAX's distributed runtime, gloo on
CPU): training and sampling tokens/s, and what sending each round's calls to the follower costs.

Both layouts run the same fsdp=2 x tp=2 mesh, the real `JaxRunner` (built by `build_runner`) driven as the
engine thread drives it; with two processes process 0 drives a `LeaderRunner` and process 1 `follow`s over
the plan channel, exactly as `python -m tx.api --coordinator ...` runs them. Workload: one LoRA run,
`--rounds` training rounds (forward_backward of `--batch` sequences of `--seq` tokens + optim_step), then
one sample request of `--samples` x `--max-tokens`. Reported per layout: training and sampling tokens/s,
ms per training round, and for two processes the plan broadcast: ms and bytes sent per round and its
share of a round (target < 5% at `small`). One JSON object on stdout.

    python benchmarks/multihost.py                 # small shape, 5 rounds
    python benchmarks/multihost.py --quick         # CI smoke: tiny shape, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_model(shape: str, out: Path) -> Path:
    """A random-weight Qwen3 checkpoint of `shape` (benchmarks/shapes.py), written by transformers."""
    import torch
    from shapes import SHAPES
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=1024, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


def items(args: argparse.Namespace) -> tuple[list[Any], list[Any], Any]:
    """(create, one training round's two items per round, the sample request) as work items."""
    from tx.protocol import (
        AdamParams,
        CreateModelRequest,
        Datum,
        ForwardBackwardRequest,
        LoraConfig,
        OptimStepRequest,
        SampleRequest,
        SamplingParams,
        WorkItem,
    )

    rng = np.random.RandomState(0)
    data = []
    for _ in range(args.batch):
        tokens = rng.randint(0, 1000, args.seq + 1)
        data.append(Datum(tokens[:-1].tolist(), {"target_tokens": tokens[1:].astype(np.int64)}))
    create = [WorkItem("create", "create_model", "run", CreateModelRequest("m", LoraConfig(8, 16.0, seed=1)), 0.0)]
    rounds = [
        [WorkItem(f"fb{i}", "forward_backward", "run", ForwardBackwardRequest(data, "cross_entropy"), 0.0),
         WorkItem(f"opt{i}", "optim_step", "run", OptimStepRequest(AdamParams(learning_rate=1e-3)), 0.0)]
        for i in range(args.rounds + 1)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=3)
    sample = WorkItem("sample", "sample", "s", SampleRequest(list(range(1, 17)), args.samples, params, "m"), 0.0)
    return create, rounds, sample


def drain(runner: Any, future_ids: set[str]) -> None:
    from tx.protocol import RequestError

    while future_ids:
        for done in runner.step():
            if isinstance(done.result, RequestError):
                raise RuntimeError(f"{done.future_id}: {done.result}")
            future_ids.discard(done.future_id)


def drive(runner: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The workload through `runner` (a JaxRunner or a LeaderRunner over one)."""
    create, rounds, sample = items(args)
    runner.submit(create)
    drain(runner, {"create"})
    runner.submit(rounds[0])  # compiles
    drain(runner, {i.future_id for i in rounds[0]})
    sent = (getattr(runner, "broadcast_s", 0.0), getattr(runner, "broadcasts", 0))
    sent_bytes = sum(len(pickle.dumps(("submit", r), protocol=pickle.HIGHEST_PROTOCOL)) for r in rounds[1:])
    start = time.perf_counter()
    for round_items in rounds[1:]:
        runner.submit(round_items)
        drain(runner, {i.future_id for i in round_items})
    train_s = time.perf_counter() - start
    broadcast_s = getattr(runner, "broadcast_s", 0.0) - sent[0]
    runner.submit([sample])  # first call compiles prefill and decode: timed on a second, same-shaped request
    drain(runner, {"sample"})
    runner.submit([sample])
    start = time.perf_counter()
    drain(runner, {"sample"})
    sample_s = time.perf_counter() - start
    tokens = args.rounds * args.batch * args.seq
    out = {
        "train_tokens_per_s": round(tokens / train_s, 1),
        "ms_per_round": round(1000 * train_s / args.rounds, 2),
        "sample_tokens_per_s": round(args.samples * args.max_tokens / sample_s, 1),
    }
    if hasattr(runner, "broadcast_s"):
        out["broadcast_ms_per_round"] = round(1000 * broadcast_s / args.rounds, 3)
        out["broadcast_calls_per_round"] = (runner.broadcasts - sent[1]) / (args.rounds + 2)
        out["broadcast_bytes_per_round"] = sent_bytes // args.rounds
        out["broadcast_share_of_round"] = round(broadcast_s / train_s, 5)
    return out


def worker(args: argparse.Namespace) -> None:
    """One process of a layout (the environment already holds its device count)."""
    import jax

    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.multihost import Cluster, LeaderRunner, follow, initialize
    from tx.engine.plan_channel import Follower, Leader
    from tx.engine.sampler import SamplerConfig

    leader = follower = None
    if args.procs > 1:
        initialize(Cluster(f"127.0.0.1:{args.coordinator_port}", args.procs, args.process_id))
        if args.process_id == 0:
            leader = Leader.listen(args.plan_port, args.procs - 1)
            leader.accept({}, timeout_s=120)
        else:
            follower = Follower.connect(f"127.0.0.1:{args.plan_port}", args.process_id, {}, timeout_s=120)
            follower.start()
    config = EngineConfig(
        data_dir=Path(args.data_dir), base_model=args.model, fsdp_size=2, tensor_parallel_size=2,
        adapters=AdapterConfig(4, 8), sampler=SamplerConfig(max_rows=args.samples, max_seq_len=512),
    )  # fmt: skip
    runner, _ = build_runner(config)
    if follower is not None:
        follow(runner, follower)
        return
    assert jax.device_count() == 4
    driven = LeaderRunner(runner, leader) if leader is not None else runner
    result = drive(driven, args)
    if leader is not None:
        driven.close()
    print("RESULT " + json.dumps(result), flush=True)


def run_layout(procs: int, args: argparse.Namespace, model: Path, data_dir: Path) -> dict[str, Any]:
    devices = 4 // procs
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "0",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}  # fmt: skip
    common = [sys.executable, str(Path(__file__).resolve()), "--worker", "--procs", str(procs), "--model", str(model),
              "--data-dir", str(data_dir / f"p{procs}"), "--coordinator-port", str(free_port()),
              "--plan-port", str(free_port()), *forwarded(args)]  # fmt: skip
    children = [
        subprocess.Popen([*common, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(procs)
    ]
    outputs = [child.communicate(timeout=1800)[0] for child in children]
    if any(child.returncode for child in children):
        raise RuntimeError(f"a {procs}-process worker failed: {[c.returncode for c in children]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return {"processes": procs, "devices_per_process": devices, **json.loads(line[len("RESULT ") :])}


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("rounds", "batch", "seq", "samples", "max_tokens")
    return [part for k in keys for part in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(args.shape, Path(tmp) / args.shape)
        layouts = [run_layout(procs, args, model, Path(tmp)) for procs in (1, 2)]
    machine = {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    one, two = layouts
    print(json.dumps({
        "benchmark": "multihost", "shape": args.shape, "mesh": "fsdp=2 x tp=2", "machine": machine,
        "workload": {k: getattr(args, k) for k in ("rounds", "batch", "seq", "samples", "max_tokens")},
        "layouts": layouts,
        "two_vs_one_train": round(two["train_tokens_per_s"] / one["train_tokens_per_s"], 3),
        "broadcast_under_5pct": two["broadcast_share_of_round"] < 0.05,
    }, indent=1))  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="CI smoke: tiny shape, 2 rounds, short sequences")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("procs", "process-id", "coordinator-port", "plan-port"):
        p.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not args.worker:
        args.shape, args.rounds, args.seq, args.samples, args.max_tokens = "tiny", 2, 32, 2, 4
    return args


if __name__ == "__main__":
    main()
