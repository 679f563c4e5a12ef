"""Load: N concurrent SDK clients, each running an RL loop against one server for a bounded time; one JSON.

Each client is its own `tinker.ServiceClient` with its own LoRA run and repeats, until the deadline,
`save_weights_and_get_sampling_client` -> `sample` -> `forward_backward(importance_sampling)` ->
`optim_step`. Reported: requests completed and failed per kind, latency p50/p99 per kind, and, read
from the server's own database afterwards, requests it lost (accepted but never finished) and
duplicated (one client request executed twice); the server's RSS after the warm-up round and at the
end. Targets: 0 failed, 0 lost, 0 duplicated, RSS growth under 5%.

    python benchmarks/load.py                     # 32 clients for 60 s on the tiny model
    python benchmarks/load.py --quick             # CI: 4 clients, 5 s warm-up + 5 s
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_loop import API_KEY, is_datum, resolve, spawn_server, tiny_model  # noqa: E402

KINDS = ("sync", "sample", "forward_backward", "optim_step")


class Tally:
    """Latencies and failures per request kind, shared by the client threads; only requests that start
    after the warm-up count towards the latencies (the first ones compile)."""

    def __init__(self, steady_from: float) -> None:
        self.steady_from = steady_from
        self.lock = threading.Lock()
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self.completed: collections.Counter[str] = collections.Counter()
        self.failed: dict[str, list[str]] = collections.defaultdict(list)

    def timed(self, kind: str, call: Any) -> Any:
        start = time.perf_counter()
        try:
            value = call()
        except Exception as err:
            with self.lock:
                self.failed[kind].append(f"{type(err).__name__}: {err}"[:300])
            raise
        with self.lock:
            self.completed[kind] += 1
            if time.monotonic() - (time.perf_counter() - start) >= self.steady_from:
                self.seconds[kind].append(time.perf_counter() - start)
        return value


def client_loop(url: str, base_model: str, deadline: float, tally: Tally, args: argparse.Namespace, seed: int) -> None:
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    training = resolve(service.create_lora_training_client(base_model=base_model, rank=4))
    prompt = [1 + (seed + i) % 50 for i in range(6)]
    step = 0
    while step == 0 or time.monotonic() < deadline:  # at least one round, however slow creating the run was
        try:
            one_step(training, prompt, step + 1000 * seed, tally, args)
        except Exception:
            pass  # counted by the tally; the client keeps going, as an RL loop with retries would
        step += 1


def one_step(training: Any, prompt: list[int], seed: int, tally: Tally, args: argparse.Namespace) -> None:
    from tinker import types

    sampler = tally.timed("sync", lambda: resolve(training.save_weights_and_get_sampling_client()))
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed)
    future = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=args.num_samples, sampling_params=params)
    result = tally.timed("sample", future.result)
    sequences = [(list(s.tokens), s.logprobs) for s in result.sequences]
    rewards = [sum(t % 2 == 0 for t in toks) / max(len(toks), 1) for toks, _ in sequences]
    mean = sum(rewards) / len(rewards)
    data = [is_datum(prompt, t, lp, r - mean) for (t, lp), r in zip(sequences, rewards, strict=True) if t]
    tally.timed("forward_backward", lambda: training.forward_backward(data, "importance_sampling").result())
    tally.timed("optim_step", lambda: training.optim_step(types.AdamParams(learning_rate=1e-3)).result())


def server_rss(parent: psutil.Process) -> int:
    children = [c for c in parent.children(recursive=True) if "tx.api" in " ".join(c.cmdline())]
    return sum(c.memory_info().rss for c in children)


def database_counts(db_path: Path) -> dict[str, int]:
    """lost: accepted futures never finished; duplicated: one (run, seq_id) executed more than once."""
    with sqlite3.connect(db_path) as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM futures GROUP BY status").fetchall())
        dupes = conn.execute(  # the SDK numbers every request of a run or sampler: a pair seen twice ran twice
            "SELECT count(*) FROM (SELECT model_id, seq_id FROM futures WHERE seq_id IS NOT NULL"
            " GROUP BY model_id, kind, seq_id HAVING count(*) > 1)"
        ).fetchone()[0]
    return {"lost": statuses.get("pending", 0) + statuses.get("running", 0), "duplicated": int(dupes), **statuses}


def quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return round(values[0], 4) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1], 4)


def run_clients(url: str, base_model: str, args: argparse.Namespace, tally: Tally) -> dict[str, int]:
    """Every client runs from start to deadline; the server's RSS is read when the warm-up ends and at the end."""
    me = psutil.Process()
    deadline = tally.steady_from + args.seconds
    threads = [
        threading.Thread(target=client_loop, args=(url, base_model, deadline, tally, args, i), daemon=True)
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    time.sleep(max(tally.steady_from - time.monotonic(), 0.0))
    rss = {"warm_up": server_rss(me)}
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0) + args.grace_s)
    rss["end"] = server_rss(me)
    return rss


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="smolgym-load-") as tmp:
        model = tiny_model(Path(tmp))
        # A run and its latest sampler snapshot per client (device slots are not paged yet).
        extra = ("--max-lora-adapters", str(2 * args.clients + 2), "--max-lora-rank", "4", *args.server_args)
        with spawn_server(model, Path(tmp) / "data", "float32", extra=extra) as url:
            tally = Tally(time.monotonic() + args.warm_up_s)
            rss = run_clients(url, str(model), args, tally)
            time.sleep(1.0)  # let the last results land
            counts = database_counts(Path(tmp) / "data" / "smolgym.db")
    out = {
        "benchmark": "load",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count()},
        "clients": args.clients,
        "seconds": args.seconds,
        "completed": {k: tally.completed[k] for k in KINDS},
        "failed": {k: len(tally.failed[k]) for k in KINDS},
        "failures": sorted({m for k in KINDS for m in tally.failed[k]})[:10],
        "lost": counts["lost"],
        "duplicated": counts["duplicated"],
        "latency_s": {
            k: {"p50": quantile(tally.seconds[k], 0.5), "p99": quantile(tally.seconds[k], 0.99)} for k in KINDS
        },  # noqa: E501
        "server_rss_mib": {phase: round(v / 2**20, 1) for phase, v in rss.items()},
        "rss_growth_pct": round(100 * (rss["end"] - rss["warm_up"]) / max(rss["warm_up"], 1), 2),
    }
    print(json.dumps(out), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32, help="concurrent SDK clients (default 32)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the measured phase (default 60)")
    p.add_argument("--warm-up-s", type=float, default=20.0, help="length of the warm-up phase (default 20)")
    p.add_argument("--grace-s", type=float, default=120.0, help="how long a client may overrun the deadline")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="further flags for the server")
    p.add_argument("--quick", action="store_true", help="CI smoke: 4 clients, 5 s warm-up, 5 s measured")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.warm_up_s, args.seconds = 4, 5.0, 5.0
    return args


if __name__ == "__main__":
    main()
