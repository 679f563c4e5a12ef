"""Round-trip overhead of trivial requests through the `tinker` SDK and plain HTTP; prints one JSON object.

Each case repeats one call whose compute is negligible, after a warm-up that pays any compile, and
reports the median, p99 and minimum wall time in milliseconds:

- `http_healthz`: `GET /api/v1/healthz` on one keep-alive connection (the HTTP stack alone),
- `sdk_capabilities`: `get_server_capabilities()` (SDK + HTTP, no queue; `RestClient`'s where the SDK has it),
- `sdk_forward`: `TrainingClient.forward` of one 2-token datum, `.result()` (queue row, engine wake-up,
  a tiny jitted forward, result row, long-poll `retrieve_future`),
- `sdk_optim_step`: `optim_step` with no gradients accumulated (queue + engine, a no-op AdamW step).

The server is started on the tiny offline model as in `rl_loop.py`, or `--url` targets a running one.

    python benchmarks/api_overhead.py [--calls 200]
    python benchmarks/api_overhead.py --quick            # CI smoke: 20 calls per case
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_loop import API_KEY, resolve, target_server  # noqa: E402


def timed(call: Callable[[], Any], calls: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return {
        "median_ms": round(statistics.median(samples), 3),
        "p99_ms": round(p99, 3),
        "min_ms": round(samples[0], 3),
        "calls": calls,
    }


def healthz(url: str) -> Callable[[], None]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)

    def call() -> None:
        conn.request("GET", "/api/v1/healthz")
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"healthz answered HTTP {response.status}")

    return call


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import tinker
    from tinker import types

    with target_server(args) as (url, base_model, _ready_s):
        service = tinker.ServiceClient(base_url=url, api_key=args.api_key)
        training = resolve(service.create_lora_training_client(base_model=base_model, rank=args.rank))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={"target_tokens": np.array([2, 3], np.int64), "weights": np.ones(2, np.float32)},
        )
        adam = types.AdamParams(learning_rate=0.0)
        rest = tinker.RestClient(base_url=url, api_key=args.api_key) if hasattr(tinker, "RestClient") else None
        capabilities = getattr(rest, "get_server_capabilities", service.get_server_capabilities)  # older SDKs
        cases: dict[str, Callable[[], Any]] = {
            "http_healthz": healthz(url),
            "sdk_capabilities": lambda: resolve(capabilities()),
            "sdk_forward": lambda: training.forward([datum], "cross_entropy").result(),
            "sdk_optim_step": lambda: training.optim_step(adam).result(),
        }
        results = {name: timed(call, args.calls, args.warmup) for name, call in cases.items()}
    return {
        "benchmark": "api_overhead",
        "target": args.url or "spawned",
        "base_model": base_model,
        "sdk": tinker.__version__,
        **results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="measure this running server instead of starting one")
    p.add_argument("--base-model", help="model directory (at least 3 path components); default: the tiny model")
    p.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", API_KEY))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="spawned server's dtype")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="timed calls per case (default 200)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per case first (default 5)")
    p.add_argument("--quick", action="store_true", help="CI smoke: 20 calls per case, 2 warm-up")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.warmup = 20, 2
    return args


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
