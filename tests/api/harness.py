"""Test harness shared by the API tests: the served model, the keys, a wire helper, the server handle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from api.fake_runner import FakeRunner
from tx.db import Database
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
