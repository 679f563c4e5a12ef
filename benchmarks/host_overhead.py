"""Host overhead: the time the engine spends outside compiled programs per training round and per decode
chunk, and the SDK round trip of a trivial request, in milliseconds and as fractions of the round.

The server's own pieces run in this process on a random-weight checkpoint of `--shape` written to a
temporary directory: the model pool of `python -m tx.api` (`build_pool`, `build_catalog`: one
`tx.engine.build_runner`), its SQLite queue and the engine loop (`tx.engine.loop.Engine`). Requests are
written to the queue as the API's routes write them, and this script calls `Engine.run_once` until their
results are recorded, so a round is everything the engine does for it: claiming and decoding the rows,
gathering the burst, planning, packing, copies to and from the device, the programs, reading results
back, encoding them and the queue writes.

- training round: one LoRA run's forward_backward (cross_entropy, `--batch` x `--length` tokens) and its
  optim_step, claimed together (a client's pipelined pair);
- sampling round: `--batch` requests of `--prompt` fresh random tokens and `--new-tokens` new ones (no
  early stop), one decode chunk of 16 steps per engine step; the first step admits and prefills them all;
- SDK round trip: `api_overhead.py --url` against this process serving HTTP afterwards (uvicorn and the
  engine thread, as `python -m tx.api` runs them); `sdk_forward`, a 2-token forward, is the trivial request.
  Its `host_ms` is the round trip minus the programs the same request runs when queued directly
  (`trivial_round`, measured like the rounds above): SDK, HTTP, queue, engine and long poll together.

Method (`program_clock.py`): `jax.jit` is wrapped before `tx` is imported, so every program's call waits
for its outputs and the wait is clocked: `program_ms`. `host_ms` = the round's wall time - `program_ms`:
Python, dispatch, eager jnp ops, copies, SQL, with nothing hidden behind a running program (the full host
cost, as an accelerator whose programs take milliseconds pays it; on CPU an upper bound, since XLA runs small
programs inline in the calling thread). `host_fraction` = host_ms / round_ms.
`async_round_ms` is the same round with the waits off, run alternately in the same process; `phases`
splits host_ms between the engine's parts (`other`: what no phase covers, mostly program dispatch).

    python benchmarks/host_overhead.py             # small shape: 8 x 256 training, 8 x (128 + 64) sampling
    python benchmarks/host_overhead.py --quick     # CI smoke: tiny shape, 2 rounds, 5 SDK calls
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_clock import Phases, ProgramClock  # noqa: E402

CLOCK = ProgramClock()
CLOCK.install()  # before anything builds a program

from shapes import SHAPES, write_checkpoint  # noqa: E402
from train_throughput import workload  # noqa: E402

from tx.db.tables import TrainingRunRow  # noqa: E402
from tx.engine import runner as runner_module  # noqa: E402
from tx.engine import sampler as sampler_module  # noqa: E402
from tx.engine import trainer as trainer_module  # noqa: E402
from tx.engine.loop import Engine  # noqa: E402
from tx.engine.runner import JaxRunner  # noqa: E402
from tx.engine.sampler import Sampler  # noqa: E402
from tx.engine.sampler_rows import Row  # noqa: E402
from tx.engine.trainer import Trainer  # noqa: E402
from tx.protocol import (  # noqa: E402
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
)

HERE = Path(__file__).resolve().parent
OWNER = "bench"
RUN = "bench:train:0"


class Bench:
    """The server's queue, pool and engine loop on one model, and the phases its host time is split into."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from tx.api.__main__ import build_catalog, build_pool, parse_args
        from tx.db import open_database
        from tx.upload_store import UploadStore

        self.model_dir = write_checkpoint(args.shape, root / "models" / "bench" / args.shape)
        flags = ["--base-model", str(self.model_dir), "--data-dir", str(root / "data"), "--log-level", "warning"]
        self.server_args = parse_args([*flags, "--train-micro-batch-tokens", str(max(8192, args.batch * args.length))])
        self.db = open_database(None, self.server_args.data_dir)
        self.uploads = UploadStore(root / "data" / "uploads", 1 << 30)
        self.pool = build_pool(self.server_args)
        self.catalog = build_catalog(self.server_args, self.pool, self.uploads)
        self.engine = Engine(self.db.queue, self.pool)
        self.phases = Phases(CLOCK)
        self._wrap_phases()
        self.seq = 0

    def _wrap_phases(self) -> None:
        """The engine's host-side parts; none of them calls another, so their times add up."""
        queue, wrap = self.db.queue, self.phases.wrap
        wrap(queue, "claim", "claim")  # SQL select + update, payloads decoded
        wrap(queue, "wait_for_work", "gather_wait")  # the burst's quiet gap (`Engine._claim_burst`)
        wrap(queue, "finish_many", "finish")  # results encoded, rows written, long polls woken
        wrap(runner_module, "plan_round", "plan")
        wrap(JaxRunner, "_resident", "plan")  # paging
        for name in ("make_example", "plan_rows", "build_batch"):
            wrap(trainer_module, name, "pack")  # datums -> packed rows -> device inputs
        wrap(trainer_module, "scatter_outputs", "readback")
        wrap(trainer_module, "to_host", "readback")
        wrap(trainer_module, "request_results", "results")  # per request: its datums' outputs, its metrics
        wrap(Trainer, "optim_step", "optim_step")  # hyper-parameters in, the gradient norm out
        wrap(Sampler, "_admit", "admission")  # waiting requests into rows, cache resized
        wrap(Sampler, "_prefill", "prefill")  # prompts batched, the prompt cache
        for name in ("decode_rows", "row_slots"):
            wrap(sampler_module, name, "row_inputs")
        wrap(sampler_module, "to_host", "readback")
        wrap(Row, "advance", "row_bookkeeping")  # tokens appended, stop checks

    def submit(self, kind: str, payload: Any, model_id: str, rows: list | None = None) -> str:
        self.seq += 1
        submitted = self.db.queue.submit(
            kind=kind, payload=payload, owner=OWNER, model_id=model_id, seq_id=self.seq, rows=rows or []
        )
        return submitted.future_id

    def steps(self) -> list[dict[str, float]]:
        """Step the engine until nothing is in flight; each step's wall, program and host seconds."""
        out = []
        while True:
            CLOCK.reset()
            start = time.perf_counter()
            self.engine.run_once()
            wall = time.perf_counter() - start
            out.append({"wall": wall, "program": CLOCK.program_s, "host": wall - CLOCK.spent()})
            if not self.engine.in_flight():
                return out

    def create_run(self, rank: int) -> None:
        run_row = TrainingRunRow(id=RUN, session_id="bench", owner=OWNER, base_model=str(self.model_dir))
        request = CreateModelRequest(str(self.model_dir), LoraConfig(rank=rank), model_dir=str(self.model_dir))
        self.submit("create_model", request, RUN, [run_row])
        self.steps()


def training_round(bench: Bench, args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    vocab = SHAPES[args.shape]["vocab_size"]
    bench.submit("forward_backward", workload(vocab, args.batch, args.length, seed), RUN)
    bench.submit("optim_step", OptimStepRequest(AdamParams(learning_rate=1e-5)), RUN)
    return bench.steps()


def sampling_round(bench: Bench, args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    rng = np.random.default_rng(seed)  # fresh prompts: no prompt cache hits
    vocab = SHAPES[args.shape]["vocab_size"]
    for i in range(args.batch):
        params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=seed * 1000 + i, stop_at_eos=False)
        prompt = rng.integers(0, vocab, args.prompt).tolist()
        request = SampleRequest(prompt, 1, params, str(bench.model_dir), model_dir=str(bench.model_dir))
        bench.submit("sample", request, f"bench:sample:{seed}")
    return bench.steps()


def trivial_round(bench: Bench, args: argparse.Namespace, seed: int) -> list[dict[str, float]]:
    """What `api_overhead.py`'s `sdk_forward` asks for: a forward of one 2-token datum."""
    datum = Datum([1, 2], {"target_tokens": np.array([2, 3], np.int64), "weights": np.ones(2, np.float32)})
    bench.submit("forward", ForwardBackwardRequest([datum], "cross_entropy", forward_only=True), RUN)
    return bench.steps()


def measure(bench: Bench, run_round: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`--warmup` rounds (compiles), then `--rounds` synchronised rounds alternating with asynchronous ones."""
    for seed in range(args.warmup):
        run_round(bench, args, seed)
    synced, unsynced = [], []
    for seed in range(args.warmup, args.warmup + args.rounds):
        CLOCK.on = True
        bench.phases.reset()
        steps = run_round(bench, args, seed)
        synced.append((steps, dict(bench.phases.seconds)))
        CLOCK.on = False
        unsynced.append(sum(s["wall"] for s in run_round(bench, args, 10_000 + seed)))
    CLOCK.on = True
    return summarise(synced, unsynced)


def summarise(synced: list[tuple[list[dict[str, float]], dict[str, float]]], unsynced: list[float]) -> dict[str, Any]:
    """Medians over rounds; phases from the round with the median host time."""
    rounds = [{k: sum(s[k] for s in steps) for k in ("wall", "program", "host")} for steps, _ in synced]
    host = [r["host"] for r in rounds]
    median_round = rounds[host.index(statistics.median_low(host))]
    phases = synced[host.index(statistics.median_low(host))][1]
    phases["other"] = median_round["host"] - sum(phases.values())
    ms = round_ms
    return {
        "round_ms": ms(statistics.median(r["wall"] for r in rounds)),
        "program_ms": ms(statistics.median(r["program"] for r in rounds)),
        "host_ms": ms(statistics.median(host)),
        "host_fraction": round(statistics.median(r["host"] / r["wall"] for r in rounds), 4),
        "async_round_ms": ms(statistics.median(unsynced)),
        "engine_steps": len(synced[0][0]),
        "host_ms_per_step_mean": ms(statistics.median(host) / len(synced[0][0])),
        "host_ms_per_step": [ms(s["host"]) for s in synced[0][0]],
        "phases_ms": {name: ms(seconds) for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1])},
        "rounds": len(rounds),
    }


def round_ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def sdk_round_trip(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """`api_overhead.py --url` against this process's HTTP server and engine thread."""
    import uvicorn

    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.demo import pick_port

    CLOCK.on = False
    settings = Settings(data_dir=Path(bench.server_args.data_dir))
    app = create_app(settings, bench.db, bench.catalog, bench.uploads)
    port = pick_port(0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, name="bench-http", daemon=True).start()
    bench.engine.start()
    try:
        while not server.started:
            time.sleep(0.05)
        cmd = [sys.executable, str(HERE / "api_overhead.py"), "--url", f"http://127.0.0.1:{port}"]
        cmd += ["--base-model", str(bench.model_dir), "--calls", str(args.sdk_calls), "--warmup", "2"]
        env = dict(os.environ, TINKER_TELEMETRY="0")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"api_overhead.py failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        server.should_exit = True
        bench.engine.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="smolgym-host-") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            bench.create_run(args.rank)
            training = measure(bench, training_round, args)
            sampling = measure(bench, sampling_round, args)
            trivial = measure(bench, trivial_round, args)
            sdk = sdk_round_trip(bench, args)
        finally:
            bench.pool.close()
            bench.db.close()
    sdk_ms = sdk["sdk_forward"]["median_ms"]
    sdk_host_ms = sdk_ms - trivial["program_ms"]
    return {
        "benchmark": "host_overhead",
        "shape": args.shape,
        "training": {"batch": args.batch, "length": args.length, "lora_rank": args.rank, **training},
        "sampling": {"batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, **sampling},
        "sdk_trivial_request": {
            "round_trip_ms": sdk_ms,
            "program_ms": trivial["program_ms"],
            "host_ms": round(sdk_host_ms, 3),
            "fraction_of_training_round": round(sdk_ms / training["round_ms"], 4),
            "host_fraction_of_training_round": round(sdk_host_ms / training["round_ms"], 4),
            "engine_round_ms": trivial["round_ms"],
        },
        "sdk": {k: v for k, v in sdk.items() if isinstance(v, dict)},
        "sdk_version": sdk.get("sdk"),
        "target_fraction": 0.05,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=[s for s in SHAPES if not s.startswith("qwen3.5")])
    p.add_argument("--batch", type=int, default=8, help="training datums and sampling requests per round")
    p.add_argument("--length", type=int, default=256, help="tokens per training datum")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the training run")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sampling request")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per request")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds of each kind (and as many without waits)")
    p.add_argument("--warmup", type=int, default=2, help="rounds first, unmeasured (compiles)")
    p.add_argument("--sdk-calls", type=int, default=100, help="timed SDK calls per case")
    p.add_argument("--quick", action="store_true", help="CI smoke: tiny shape, 2 x 32 training, 2 x (16 + 16)")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.batch, args.length, args.prompt, args.new_tokens = "tiny", 2, 32, 16, 16
        args.rounds, args.warmup, args.sdk_calls = 2, 1, 5
    return args


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv)), indent=1), flush=True)


if __name__ == "__main__":
    main()
