"""FakeRunner: a test-only stand-in for the JAX runner (never shipped in `tx`).

It completes work items with results of the right types and shapes, so the API, the queue, the
long poll and the SDK's decoding can be tested without a model. Magic inputs drive the failure
paths: a datum or prompt starting with token 998 fails that request with a user error, 999 makes
`step` raise a `StepError` for that request only. `paused` holds all work (to test the 408 path).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tx.engine.loop import Completion, StepError
from tx.protocol import (
    CheckpointResult,
    CreateModelResult,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadResult,
    OptimStepResult,
    RequestError,
    Result,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SaveSamplerRequest,
    SaveStateRequest,
    TopkLogprobs,
    UnloadResult,
    WorkItem,
)

FAIL_USER, FAIL_RAISE = 998, 999


class FakeRunner:
    def __init__(self) -> None:
        self.pending: deque[WorkItem] = deque()
        self.seen: list[WorkItem] = []
        self.paused = threading.Event()
        self.lock = threading.Lock()

    def submit(self, items: Sequence[WorkItem]) -> None:
        with self.lock:
            self.pending.extend(items)
            self.seen.extend(items)

    def idle(self) -> bool:
        return not self.pending

    def step(self) -> list[Completion]:
        if self.paused.is_set():
            self.paused.wait(0.02)
            return []
        done: list[Completion] = []
        while self.pending:
            item = self.pending.popleft()
            if _first_token(item) == FAIL_RAISE:
                raise StepError("fake runner exploded", [item.future_id])
            done.append(Completion(item.future_id, self._run(item)))
        return done

    def _run(self, item: WorkItem) -> Result | RequestError:
        if _first_token(item) == FAIL_USER:
            return RequestError("fake runner: token 998 is not allowed here", "user")
        payload = item.payload
        if item.kind == "create_model":
            return CreateModelResult(str(item.model_id))
        if isinstance(payload, ForwardBackwardRequest):
            return _forward_backward(payload)
        if item.kind == "optim_step":
            return OptimStepResult({"grad_norm:mean": 1.0})
        if isinstance(payload, SaveStateRequest):
            return _save(payload.dest_dir, payload.tinker_path)
        if isinstance(payload, SaveSamplerRequest):
            if payload.dest_dir is None:
                return CheckpointResult(sampling_session_id=payload.snapshot_id)
            return _save(payload.dest_dir, payload.tinker_path)
        if item.kind in ("load_state", "load_weights"):
            return LoadResult(str(item.model_id))
        if isinstance(payload, SampleRequest):
            return _sample(payload)
        return UnloadResult(str(item.model_id))


def _first_token(item: WorkItem) -> int | None:
    payload = item.payload
    if isinstance(payload, ForwardBackwardRequest) and payload.data:
        return payload.data[0].tokens[0]
    if isinstance(payload, SampleRequest):
        return payload.prompt[0]
    return None


def _forward_backward(request: ForwardBackwardRequest) -> ForwardBackwardResult:
    outputs = []
    for datum in request.data:
        targets = datum.loss_fn_inputs["target_tokens"]
        outputs.append({"logprobs": -(targets % 7).astype(np.float32) / 10})
    total = float(sum(-o["logprobs"].sum() for o in outputs))
    return ForwardBackwardResult(outputs, {"loss:sum": total})


def _save(dest_dir: str | None, tinker_path: str | None) -> CheckpointResult:
    assert dest_dir is not None
    path = Path(dest_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    return CheckpointResult(path=tinker_path, size_bytes=8)


def _sample(request: SampleRequest) -> SampleResult:
    n_new = min(request.params.max_tokens, 3)
    sequences = [
        SampledSequence([(request.prompt[-1] + i + j) % 50 for j in range(n_new)], [-0.5] * n_new, "length")
        for i in range(request.num_samples)
    ]
    P, k = len(request.prompt), request.topk_prompt_logprobs
    prompt_lp = np.full(P, -1.0, np.float32) if request.prompt_logprobs else None
    if prompt_lp is not None:
        prompt_lp[0] = np.nan
    ids = np.broadcast_to(np.arange(k, dtype=np.int32), (P, k))
    topk = TopkLogprobs(ids, (-0.1 * (ids + 1)).astype(np.float32)) if k else None
    return SampleResult(sequences, prompt_lp, topk)
