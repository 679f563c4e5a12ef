"""Test harness shared by the API tests: served model, keys, a wire helper, and a real server in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from tinker.proto import tinker_public_pb2 as pb

from api.fake_runner import FakeRunner
from tx.api.app import create_app
from tx.api.context import Settings
from tx.db import Database, open_database
from tx.engine.loop import Engine, Runner
from tx.protocol import ModelInfo

MODEL = ModelInfo(
    base_model="smolgym/tiny-test", vocab_size=1000, max_seq_len=128, tokenizer_id="gpt2", max_lora_rank=32
)
KEY = "tml-alice"
OTHER_KEY = "tml-bob"
PROTO = {"Content-Type": "application/x-protobuf"}


@dataclass
class Server:
    url: str
    runner: FakeRunner
    db: Database
    data_dir: Path


def proto_body(model_id: str, seq_id: int, tokens: list[int], targets: list[int] | None = None, **extra: Any) -> bytes:
    """A serialized ForwardBackwardRequest with one datum (built with the SDK's own protobuf module)."""
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=extra.pop("loss_fn", "cross_entropy"))
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    target_values = targets if targets is not None else tokens
    target = datum.loss_fn_inputs["target_tokens"]
    target.dense = np.asarray(target_values, np.int64).tobytes()
    target.dtype = pb.DTYPE_INT64
    target.shape.append(len(target_values))
    for key, value in extra.items():
        request.loss_fn_config_v2[key].number = value
    return bytes(request.SerializeToString())


@contextlib.contextmanager
def running_server(
    runner: Runner, model: ModelInfo, data_dir: Path, hold_s: float = 1.0, **settings: Any
) -> Iterator[tuple[str, Database]]:
    """Database + engine thread + uvicorn on a free loopback port, torn down on exit; `settings` are
    further `Settings` fields (e.g. max_runs)."""
    db = open_database(None, data_dir)
    db.queue.recover()
    engine = Engine(db.queue, runner)
    engine.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    app = create_app(Settings(data_dir=data_dir, retrieve_hold_s=hold_s, **settings), db, model)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not uv.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", db
    finally:
        uv.should_exit = True
        thread.join(5)
        engine.stop()
        db.close()
