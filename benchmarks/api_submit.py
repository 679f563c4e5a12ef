"""How fast does the API accept large forward_backward submissions? Prints one JSON object.

Starts the real app on a loopback port with a SQLite database in a temporary directory (no engine:
this measures validation + queueing only) and creates a training run; a separate client process
(like a real SDK user) then POSTs N concurrent protobuf forward_backward requests of about `--kb`
KiB each. Reports the wall time until every request has its future id, and latency percentiles.

    .venv/bin/python benchmarks/api_submit.py [--requests 100] [--kb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import tempfile
import threading
import time

import httpx
import numpy as np
import uvicorn

from tx.api import wire_proto
from tx.api.app import create_app
from tx.api.context import Settings
from tx.db import open_database
from tx.protocol import CreateModelResult, ModelInfo

MODEL = ModelInfo(base_model="bench/model", vocab_size=32000, max_seq_len=65536, tokenizer_id="gpt2")
HEADERS = {"X-API-Key": "tml-bench"}


def proto_body(model_id: str, seq_id: int, n_tokens: int) -> bytes:
    """One datum: int32 tokens + int64 targets + float32 weights = 16 bytes per token."""
    request = wire_proto.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = request.data.add()
    tokens = np.random.default_rng(seq_id).integers(0, MODEL.vocab_size, n_tokens)
    datum.model_input.add().encoded_text.tokens = tokens.astype(np.int32).tobytes()
    for name, array, dtype in (("target_tokens", tokens, 2), ("weights", np.ones(n_tokens), 1)):
        tensor = datum.loss_fn_inputs[name]
        tensor.dense = array.astype(np.int64 if dtype == 2 else np.float32).tobytes()
        tensor.dtype = dtype
        tensor.shape.append(n_tokens)
    return bytes(request.SerializeToString())


def start_server(data_dir: str) -> tuple[str, object, uvicorn.Server]:
    db = open_database(None, data_dir)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(), db, MODEL), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}/api/v1", db, server


def create_run(base: str, db: object) -> str:
    with httpx.Client(base_url=base, headers=HEADERS) as http:
        session_id = http.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "base_model": MODEL.base_model, "lora_config": {"rank": 8}}
        future = http.post("/create_model", json=body).json()
    items = db.queue.claim(10)  # type: ignore[attr-defined]
    db.queue.complete(items[0].future_id, CreateModelResult(future["model_id"]))  # type: ignore[attr-defined]
    return str(future["model_id"])


def client_process(base: str, model_id: str, requests: int, kb: int) -> tuple[float, list[float], int]:
    """Runs in a separate process, like a real SDK client: build the bodies, then fire them at once."""
    bodies = [proto_body(model_id, i + 1, kb * 1024 // 16) for i in range(requests)]
    wall, latencies = asyncio.run(submit_all(base, bodies))
    return wall, latencies, len(bodies[0])


async def post_raw(host: str, port: int, path: str, body: bytes) -> float:
    """One POST over a fresh connection, request written in one go (measures the server, not a client library)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {HEADERS['X-API-Key']}\r\n"
        f"Content-Type: application/x-protobuf\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + body)
    await writer.drain()
    response = await reader.read()
    writer.close()
    if not response.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(response[:300].decode(errors="replace"))
    return time.perf_counter() - start


async def submit_all(base: str, bodies: list[bytes]) -> tuple[float, list[float]]:
    host_port = base.split("//", 1)[1].split("/", 1)[0]
    host, port = host_port.split(":")
    path = "/" + base.split("//", 1)[1].split("/", 1)[1] + "/forward_backward"
    start = time.perf_counter()
    latencies = await asyncio.gather(*(post_raw(host, int(port), path, b) for b in bodies))
    return time.perf_counter() - start, list(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--kb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        base, db, server = start_server(data_dir)
        model_id = create_run(base, db)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            wall, latencies, body_bytes = pool.apply(client_process, (base, model_id, args.requests, args.kb))
        server.should_exit = True
    p50, p99 = (round(float(np.percentile(np.array(latencies) * 1000, q)), 2) for q in (50, 99))
    print(json.dumps({
        "benchmark": "api_submit", "database": "sqlite", "requests": args.requests, "body_bytes": body_bytes,
        "wall_s": round(wall, 4), "requests_per_s": round(args.requests / wall, 1),
        "latency_ms_p50": p50, "latency_ms_p99": p99,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
