"""`python -m tx.demo`: SmolGym end to end on a built-in tiny model, offline.

Writes the tiny model under ./smolgym-data/models/tiny-qwen3 (once), starts the real server
(`python -m tx.api`) as a child process, waits for its ready line, then runs examples/rl_loop.py and
examples/sl_loop.py against it as separate processes, exactly as a user's own scripts would run, and
stops the server. The examples use only the `tinker` SDK.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tx.models.tiny import write_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
READY = "SmolGym ready on "
API_KEY = "tml-demo"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tx.demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="training steps per example loop (default 12)")
    p.add_argument(
        "--port", type=int, default=None, help="server port (default 8000 if free, else any; 0: any free port)"
    )
    p.add_argument("--data-dir", default="./smolgym-data", help="server data directory (default ./smolgym-data)")
    p.add_argument("--keep-server", action="store_true", help="leave the server running after the examples")
    p.add_argument(
        "--seed", type=int, default=None, help="seed both loops' adapters and the RL loop's sampling (a repeatable run)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    return p.parse_args(argv)


def pick_port(preferred: int = 8000) -> int:
    for port in (preferred, 0):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port")


def child_env(url: str, model_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TINKER_TELEMETRY="0",
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",  # "PyTorch was not found" is not news: the examples use only tokenizers
        TINKER_BASE_URL=url,
        TINKER_API_KEY=API_KEY,
        TINKER_BASE_MODEL=str(model_dir),
    )
    return env


def start_server(model_dir: Path, port: int, data_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tx.api", "--base-model", str(model_dir), "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--dtype", "float32", "--log-level", "warning"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(server: subprocess.Popen[str], timeout: float) -> None:
    """Echo the server's output (prefixed) until its ready line; keep echoing in the background."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"the server exited with code {server.wait()} before it was ready")
        print(f"[server] {line}", end="", flush=True)
        if READY in line:
            threading.Thread(target=_drain, args=(lines,), daemon=True).start()
            return
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def _drain(lines: queue.Queue[str | None]) -> None:
    while (line := lines.get()) is not None:
        print(f"[server] {line}", end="", flush=True)


def run_example(name: str, steps: int, env: dict[str, str], *extra: str) -> int:
    print(f"\n=== examples/{name} ===", flush=True)
    return subprocess.call([sys.executable, str(EXAMPLES / name), "--steps", str(steps), *extra], env=env)


def stop(server: subprocess.Popen[str]) -> None:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    data_dir = Path(args.data_dir).expanduser().absolute()
    model_dir = write_tiny_model(data_dir / "models" / "tiny-qwen3")
    port = args.port or pick_port(8000 if args.port is None else 0)
    url = f"http://127.0.0.1:{port}"
    env = child_env(url, model_dir)
    print(f"tiny model: {model_dir}\nstarting SmolGym on {url} ...", flush=True)
    server = start_server(model_dir, port, data_dir, env)
    code = 1
    try:
        wait_ready(server, args.timeout)
        seed = () if args.seed is None else ("--seed", str(args.seed))
        code = run_example("rl_loop.py", args.steps, env, *seed) or run_example("sl_loop.py", args.steps, env, *seed)
        if args.keep_server and code == 0:
            print(f"\nserver still running on {url} (Ctrl-C to stop)", flush=True)
            server.wait()
    except KeyboardInterrupt:
        code = 130
    except (RuntimeError, TimeoutError) as err:  # the server's own lines above say why
        print(f"error: {err}", flush=True)
    finally:
        stop(server)
    print("demo " + ("finished" if code == 0 else f"failed (exit {code})"), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
