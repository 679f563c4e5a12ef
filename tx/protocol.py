"""Payload types that cross the queue between the API, the database and the engine.

This is a leaf module: plain dataclasses over Python values and numpy arrays, no JAX and no imports
from the rest of `tx`. The API turns wire requests (JSON or protobuf) into these request types, the
database stores them as serialized blobs, and the engine's runner consumes them as `WorkItem`s and
answers with one of the result types or a `RequestError`. Token sequences are flat `list[int]`;
per-datum loss inputs and outputs are numpy arrays whose shape is the tensor's shape.
Checkpoint locations are decided by the API (inside the data directory) and passed in as plain
directory paths, so the runner never needs the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# ---------------------------------------------------------------------------------------------
# Constants shared by validation (api) and execution (engine)
# ---------------------------------------------------------------------------------------------

LOSS_NAMES: tuple[str, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)
"""Loss functions a `forward_backward` request may name."""

WorkKind = Literal[
    "create_model",
    "forward",
    "forward_backward",
    "optim_step",
    "save_state",
    "save_weights_for_sampler",
    "load_state",
    "load_weights",
    "sample",
    "unload_model",
]
ErrorCategory = Literal["user", "server", "unknown"]
StopReason = Literal["stop", "length"]
SamplerKind = Literal["snapshot", "inflight"]


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know about the loaded base model to validate requests."""

    base_model: str
    vocab_size: int
    max_seq_len: int
    tokenizer_id: str
    max_lora_rank: int = 128
    max_lora_adapters: int = 8
    loss_names: tuple[str, ...] = LOSS_NAMES
    arch: str = ""


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


# Tinker fixes alpha at 32 for every adapter (scale = 32 / rank); see shared/tinker-protocol.md §7.1.
DEFAULT_LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraConfig:
    """Adapter shape; scale = alpha / rank. Which projections get adapters is set by the flags."""

    rank: int
    alpha: float = DEFAULT_LORA_ALPHA
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None


def weights_shape(lora: LoraConfig | None) -> tuple[int, bool, bool, bool] | None:
    """What a run's weights are made of, as a checkpoint must match it: None for full fine-tuning, else
    (rank, attn, mlp, unembed). Alpha and seed change values, not shapes."""
    return None if lora is None else (lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)


@dataclass(frozen=True)
class CreateModelRequest:
    """Create training run `WorkItem.model_id` on `base_model`; `lora=None` means full fine-tuning.

    `model_dir` (here, in `LoadWeightsRequest` and in `SampleRequest`): where the API located the model's
    files; the engine keys loaded models by it. Empty: the engine locates `base_model` itself."""

    base_model: str
    lora: LoraConfig | None
    user_metadata: dict[str, str] = field(default_factory=dict)
    model_dir: str = ""


@dataclass
class Datum:
    """One training example: input tokens and loss inputs whose leading dimension is len(tokens)."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardRequest:
    """Kind `forward_backward` (accumulate gradients) or `forward` (`forward_only=True`, no gradients)."""

    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters for one step (torch.optim.AdamW semantics; grad_clip_norm 0 = off)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class OptimStepRequest:
    """Apply the gradients accumulated since the previous step, then zero them."""

    adam: AdamParams


@dataclass(frozen=True)
class SaveStateRequest:
    """Write adapter weights and optimizer state into `dest_dir` (created by the runner, atomically)."""

    name: str
    dest_dir: str
    tinker_path: str


@dataclass(frozen=True)
class SaveSamplerRequest:
    """Snapshot the current weights for sampling under `snapshot_id`.

    `dest_dir` is set for named saves (PEFT files on disk, `tinker_path` is their address) and None
    for ephemeral ones, which only live in memory (`snapshot_id` is then the sampling session id, unless
    `session_id` names it: an `inflight` save writes its run's one shared snapshot, `inflight_snapshot_id`,
    and answers with the new client's own session).
    """

    snapshot_id: str
    kind: SamplerKind = "snapshot"
    name: str | None = None
    dest_dir: str | None = None
    tinker_path: str | None = None
    session_id: str | None = None

    @property
    def answer_session(self) -> str:
        """The sampling session id the save answers with."""
        return self.session_id or self.snapshot_id


def inflight_snapshot_id(run_id: str) -> str:
    """The one snapshot every `inflight` sampling client of a run reads: each inflight save rewrites it."""
    return f"{run_id}:inflight"


@dataclass(frozen=True)
class LoadStateRequest:
    """Load a training checkpoint into an existing run (`with_optimizer` restores Adam state too)."""

    source_dir: str
    tinker_path: str
    with_optimizer: bool = False


@dataclass(frozen=True)
class LoadWeightsRequest:
    """Create run `WorkItem.model_id` from a training checkpoint (SDK 0.38 create-from-state path)."""

    base_model: str
    lora: LoraConfig | None
    source_dir: str
    tinker_path: str
    with_optimizer: bool = False
    user_metadata: dict[str, str] = field(default_factory=dict)
    model_dir: str = ""


@dataclass(frozen=True)
class WeightsRef:
    """Which weights a sampler uses: an in-memory snapshot id, reloadable from `checkpoint_dir`."""

    snapshot_id: str
    model_id: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_type: Literal["sampler", "training"] = "sampler"


@dataclass(frozen=True)
class SamplingParams:
    """Generation controls. `stop_at_eos` is False only when the caller passed `stop=[]` (no stop at all)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    stop_at_eos: bool = True


@dataclass
class SampleRequest:
    """Generate `num_samples` continuations of `prompt`; `weights=None` samples the base model."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    base_model: str
    weights: WeightsRef | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    sequence_ids: list[str] = field(default_factory=list)
    model_dir: str = ""
    prompt_logprobs_last_n: int | None = None  # only the last N prompt positions scored (None: all)


@dataclass(frozen=True)
class UnloadModelRequest:
    """Free the run's adapter slot and optimizer state."""


Payload = (
    CreateModelRequest
    | ForwardBackwardRequest
    | OptimStepRequest
    | SaveStateRequest
    | SaveSamplerRequest
    | LoadStateRequest
    | LoadWeightsRequest
    | SampleRequest
    | UnloadModelRequest
)


@dataclass
class WorkItem:
    """One queued request. `model_id` is the training run, or the sampling session for `sample`.

    `seq_id` is the client's per-run (or per-sampler) sequence number; a run's training items must
    execute in `seq_id` order (SDK contract), samples may run in any order.
    """

    future_id: str
    kind: WorkKind
    model_id: str | None
    payload: Payload
    created_at: float
    seq_id: int | None = None
    owner: str = ""  # the API key's owner id (`tx.db.owner_of`): whose share a snapshot it makes counts in
    nbytes: int = 0  # the stored request's size: what the engine holds in flight is bounded in bytes too


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class CreateModelResult:
    model_id: str


@dataclass
class ForwardBackwardResult:
    """Per-datum outputs (always `logprobs`, shaped like `target_tokens`) and `name:reduction` metrics."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    output_type: str = "ArrayRecord"


@dataclass
class OptimStepResult:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class CheckpointResult:
    """Result of save_state / save_weights_for_sampler; ephemeral sampler saves have no path."""

    path: str | None = None
    sampling_session_id: str | None = None
    size_bytes: int | None = None


@dataclass
class LoadResult:
    model_id: str
    path: str | None = None


@dataclass
class UnloadResult:
    model_id: str


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass
class TopkLogprobs:
    """The k likeliest tokens at each of a prompt's P positions, likeliest first: `ids` [P, k] int32 and
    `logprobs` [P, k] float32. Row 0 (nothing precedes the first token) is undefined: ids 0, logprobs NaN."""

    ids: np.ndarray
    logprobs: np.ndarray


@dataclass
class SampleResult:
    """`prompt_logprobs` [P] float32 scores each prompt token given the ones before it; entry 0 is NaN (the
    wire's None). Arrays, not lists of floats: a long prompt's scores are stored and sent as raw bytes, never
    turned into Python objects one by one on the engine thread. `scored_from`: the first position the wire
    carries a score for (1; P - N under `prompt_logprobs_last_n`), the ones before it are None."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None
    scored_from: int = 1


@dataclass(frozen=True)
class LostState:
    """What a restart lost: the in-memory state a dead engine process held, as its database knew it.

    `runs`: run id -> the tinker path of its last training checkpoint (None: it saved none); their
    weights, gradients and optimizer state are gone. `snapshots`: sampler snapshots that lived only in
    memory (ephemeral saves). Named sampler checkpoints are on disk and reload, so they are not here."""

    runs: dict[str, str | None] = field(default_factory=dict)
    snapshots: frozenset[str] = frozenset()


@dataclass
class RequestError(Exception):
    """A failed request. `user` errors are the caller's fault; `server` errors are ours."""

    message: str
    category: ErrorCategory = "server"

    def __str__(self) -> str:
        return self.message


class QueueUnavailable(Exception):
    """The work queue takes no writes now (a full disk, a lost database connection): what could not be
    written is to be written again later, not given up as a failure."""


Result = (
    CreateModelResult
    | ForwardBackwardResult
    | OptimStepResult
    | CheckpointResult
    | LoadResult
    | UnloadResult
    | SampleResult
)

PROTOCOL_TYPES: tuple[type, ...] = (
    LoraConfig,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    AdamParams,
    OptimStepRequest,
    SaveStateRequest,
    SaveSamplerRequest,
    LoadStateRequest,
    LoadWeightsRequest,
    WeightsRef,
    SamplingParams,
    TopkLogprobs,
    SampleRequest,
    UnloadModelRequest,
    CreateModelResult,
    ForwardBackwardResult,
    OptimStepResult,
    CheckpointResult,
    LoadResult,
    UnloadResult,
    SampledSequence,
    SampleResult,
    RequestError,
)
"""Every type the database codec may reconstruct (nothing else is ever instantiated from a blob)."""
