"""End-to-end RL steps per second through the real `tinker` SDK against a real server; prints one JSON object.

One RL step is what a user's RL script does: `save_weights_and_get_sampling_client().result()` (sync),
`sample(num_samples=N, max_tokens=T)` on one prompt of P tokens, a toy reward (fraction of even token
ids) turned into group-centred advantages, `forward_backward(importance_sampling)` and `optim_step`
(train). The first step pays the compiles and is reported separately; steady figures are over the rest.

By default the script writes the tiny offline model (`tx.models.tiny`) into a temporary directory and
starts `python -m tx.api` on it as a child process; `--url` measures a server that is already running
instead (SmolGym or any Tinker server, e.g. the peer via /work/shared/bench), and then imports nothing
from `tx`, so it also runs in another SDK's environment.

    python benchmarks/rl_loop.py                          # tiny model, 10 steps, N=8 T=16
    python benchmarks/rl_loop.py --base-model /tmp/models/small
    python benchmarks/rl_loop.py --url http://127.0.0.1:8011 --base-model /tmp/models/small
    python benchmarks/rl_loop.py --quick                  # CI smoke: 2 steps, N=4 T=8
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

READY = "SmolGym ready on "
API_KEY = "tml-bench"


def tiny_model(root: Path) -> Path:
    """The tiny offline Qwen3 under `root/models/tiny/qwen3` (the SDK reads paths as org/model/variant)."""
    from tx.models.tiny import write_tiny_model

    return write_tiny_model(root / "models" / "tiny" / "qwen3")


def wait_ready(server: subprocess.Popen[str], timeout: float) -> None:
    """Read the server's output until its ready line, then keep draining it so the pipe never fills."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    ready = threading.Event()

    def pump() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            tail.append(line)
            if READY in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if server.poll() is not None or time.monotonic() > deadline:
            sys.stderr.write("".join(tail))
            raise RuntimeError(f"server not ready (exit code {server.poll()}) after {timeout:.0f} s")


@contextmanager
def spawn_server(
    base_model: Path, data_dir: Path, dtype: str, timeout: float = 300.0, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """Run `python -m tx.api` (with `extra` flags) on a free loopback port; yield its URL once ready."""
    from tx.demo import pick_port, stop  # only here: with --url this script imports nothing from tx

    port = pick_port(0)
    cmd = [sys.executable, "-m", "tx.api", "--base-model", str(base_model), "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--dtype", dtype, "--log-level", "warning", "--api-key", API_KEY, *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(server, timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server)


@contextmanager
def target_server(args: argparse.Namespace) -> Iterator[tuple[str, str, float]]:
    """(url, base model, seconds until ready): the `--url` server, or a child server on the tiny model."""
    if args.url:
        if not args.base_model:
            raise SystemExit("--url needs --base-model (the model name the server serves)")
        yield args.url, args.base_model, 0.0
        return
    with tempfile.TemporaryDirectory(prefix="smolgym-bench-") as tmp:
        model = Path(args.base_model) if args.base_model else tiny_model(Path(tmp))
        start = time.perf_counter()
        with spawn_server(model, Path(tmp) / "data", args.dtype) as url:
            yield url, str(model), time.perf_counter() - start


def resolve(value: Any) -> Any:
    """SDK 0.38 returns futures of clients; older SDKs return the clients themselves."""
    import tinker

    future_type = getattr(tinker, "APIFuture", None)
    if isinstance(future_type, type) and isinstance(value, future_type):
        return value.result()  # 0.38's client futures also look like clients: test for the future first
    if callable(getattr(value, "result", None)) and not hasattr(value, "forward_backward"):
        return value.result()
    return value


def sampling_client(training: Any, step: int) -> Any:
    try:
        return resolve(training.save_weights_and_get_sampling_client())
    except TypeError:  # SDK versions before 0.2x require a name
        return resolve(training.save_weights_and_get_sampling_client(name=f"rl-bench-{step}"))


def is_datum(prompt: list[int], tokens: list[int], logprobs: list[float] | None, advantage: float) -> Any:
    """Importance-sampling datum: sampler logprobs and the advantage on the generated positions only."""
    import numpy as np
    from tinker import types

    full = prompt + tokens
    n, start = len(full) - 1, len(prompt) - 1
    old = np.zeros(n, np.float32)
    old[start:] = logprobs if logprobs is not None else 0.0
    adv = np.zeros(n, np.float32)
    adv[start:] = advantage
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(full[1:], np.int64), "logprobs": old, "advantages": adv},
    )


def rl_step(training: Any, step: int, prompt: list[int], args: argparse.Namespace) -> dict[str, float]:
    from tinker import types

    t0 = time.perf_counter()
    sampler = sampling_client(training, step)
    t1 = time.perf_counter()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step)
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=args.num_samples, sampling_params=params)
    sequences = [(list(s.tokens), s.logprobs) for s in result.result().sequences]
    t2 = time.perf_counter()
    rewards = [sum(t % 2 == 0 for t in toks) / len(toks) if toks else 0.0 for toks, _ in sequences]
    mean = sum(rewards) / len(rewards)
    data = [is_datum(prompt, t, lp, r - mean) for (t, lp), r in zip(sequences, rewards, strict=True) if t]
    training.forward_backward(data, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=args.learning_rate)).result()
    t3 = time.perf_counter()
    generated = sum(len(t) for t, _ in sequences)
    return {"step_s": t3 - t0, "sync_s": t1 - t0, "sample_s": t2 - t1, "train_s": t3 - t2, "tokens": generated}


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    first, steady = steps[0], steps[1:] or steps[:1]

    def med(key: str) -> float:
        return round(statistics.median(s[key] for s in steady), 4)

    total = sum(s["step_s"] for s in steady)
    return {
        "steps_per_s": round(len(steady) / total, 3),
        "median_step_s": med("step_s"),
        "first_step_s": round(first["step_s"], 3),
        "first_sync_s": round(first["sync_s"], 3),
        "first_sample_s": round(first["sample_s"], 3),
        "first_train_s": round(first["train_s"], 3),
        "slowest_steady_step_s": round(max(s["step_s"] for s in steady), 3),
        "sync_s": med("sync_s"),
        "sample_s": med("sample_s"),
        "train_s": med("train_s"),
        "sampled_tokens_per_s": round(sum(s["tokens"] for s in steady) / sum(s["sample_s"] for s in steady), 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tinker

    with target_server(args) as (url, base_model, ready_s):
        service = tinker.ServiceClient(base_url=url, api_key=args.api_key)
        start = time.perf_counter()
        training = resolve(service.create_lora_training_client(base_model=base_model, rank=args.rank))
        create_s = time.perf_counter() - start
        prompt = [1 + (7 * i) % 200 for i in range(args.prompt_tokens)]  # ids valid in any vocabulary >= 256
        steps = [rl_step(training, step, prompt, args) for step in range(args.steps)]
    return {
        "benchmark": "rl_loop",
        "target": args.url or "spawned",
        "base_model": base_model,
        "sdk": tinker.__version__,
        "machine": platform.machine(),
        "steps": args.steps,
        "num_samples": args.num_samples,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rank": args.rank,
        "server_ready_s": round(ready_s, 2),
        "create_client_s": round(create_s, 3),
        **summarise(steps),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="measure this running server instead of starting one")
    p.add_argument("--base-model", help="model directory (at least 3 path components); default: the tiny model")
    p.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", API_KEY))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="spawned server's dtype")
    p.add_argument("--steps", type=int, default=10, help="RL steps, the first of which compiles (default 10)")
    p.add_argument("--num-samples", "-N", type=int, default=8, help="completions per step (default 8)")
    p.add_argument("--max-tokens", "-T", type=int, default=16, help="new tokens per completion (default 16)")
    p.add_argument("--prompt-tokens", "-P", type=int, default=16, help="prompt length (default 16)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--quick", action="store_true", help="CI smoke: 2 steps, N=4, T=8, P=8")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.num_samples, args.max_tokens, args.prompt_tokens = 2, 4, 8, 8
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(json.dumps(run(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
