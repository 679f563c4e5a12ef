"""Pydantic models of the JSON request bodies (SDK 0.38 field names; unknown fields are ignored).

Optional fields mirror what older SDKs may omit. FastAPI rejects a body that does not fit with a
422 whose detail lists the offending field, before any route code runs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, BeforeValidator, Field

from tx.protocol import AdamParams

# Every integer a client sends ends up in a 64-bit database column or array: out of range is a 422.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
PageLimit = Annotated[int, Query(ge=1, le=1000)]
PageOffset = Annotated[int, Query(ge=0, lt=2**63)]
MAX_METADATA_BYTES = 64 << 10


def _bounded_metadata(value: Any) -> Any:
    """Metadata is stored with its row and read back by listings and searches: at most 64 KiB as strict
    JSON (a NaN was stored, and every later read of the row failed to encode it: a 500 for good). Checked
    before its entries are: 100,000 entries of the wrong type had made as many errors, megabytes of them."""
    if value is None:
        return value
    try:
        size = len(json.dumps(value, allow_nan=False))
    except ValueError:
        raise ValueError("user_metadata holds NaN or an infinity, which JSON does not allow") from None
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"user_metadata is over {MAX_METADATA_BYTES} bytes as JSON")
    return value


# The user_metadata of a session, run or checkpoint; tags of a session: bounded, like everything stored.
Metadata = Annotated[dict[str, Any] | None, BeforeValidator(_bounded_metadata)]
StringMetadata = Annotated[dict[str, str] | None, BeforeValidator(_bounded_metadata)]
MetadataFilter = Annotated[dict[str, str], BeforeValidator(_bounded_metadata)]  # a search's, bounded alike
Tags = Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)]


class ClientConfigRequest(BaseModel):
    sdk_version: str | None = None


class CreateSessionRequest(BaseModel):
    tags: Tags = Field(default_factory=list)
    user_metadata: Metadata = None
    sdk_version: Annotated[str, Field(max_length=64)] | None = None


class SessionRef(BaseModel):
    session_id: str


class FinishReason(BaseModel):
    type: Annotated[str, Field(max_length=256)] = "success"  # stored with the session


class FinishSessionRequest(BaseModel):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: Annotated[str, Field(max_length=4096)] | None = None


class LoraConfigIn(BaseModel):
    rank: Int64 = 32
    seed: Int64 | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(BaseModel):
    type: str = "adamw"


class CreateModelRequest(BaseModel):
    session_id: str | None = None  # SDKs before 0.3 have no sessions
    model_seq_id: Int64 = 0
    base_model: str
    lora_config: LoraConfigIn = Field(default_factory=LoraConfigIn)
    user_metadata: StringMetadata = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(BaseModel):
    model_id: str


_ADAM = AdamParams()  # the defaults live once, on the protocol type


class AdamParamsIn(BaseModel):
    learning_rate: float = _ADAM.learning_rate
    beta1: float = _ADAM.beta1
    beta2: float = _ADAM.beta2
    eps: float = _ADAM.eps
    weight_decay: float = _ADAM.weight_decay
    grad_clip_norm: float = _ADAM.grad_clip_norm


class OptimStepRequest(BaseModel):
    model_id: str
    seq_id: Int64 | None = None
    adam_params: AdamParamsIn | None = None
    optim_params: AdamParamsIn | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(BaseModel):
    model_id: str
    path: str | None = None
    seq_id: Int64 | None = None
    overwrite: bool = False
    ttl_seconds: Int64 | None = None
    user_metadata: StringMetadata = None


class SaveWeightsForSamplerRequest(BaseModel):
    model_id: str
    path: str | None = None
    seq_id: Int64 | None = None
    sampling_session_seq_id: Int64 | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: Int64 | None = None
    user_metadata: StringMetadata = None


class LoadWeightsRequest(BaseModel):
    path: str
    model_id: str | None = None
    seq_id: Int64 | None = None
    session_id: str | None = None
    model_seq_id: Int64 | None = None
    base_model: str | None = None
    user_metadata: StringMetadata = None
    optimizer: bool = False


class WeightsInfoRequest(BaseModel):
    tinker_path: str


class CreateSamplingSessionRequest(BaseModel):
    session_id: str
    sampling_session_seq_id: Int64 = 0
    base_model: str | None = None
    model_path: str | None = None


class SampleRequest(BaseModel):
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    num_samples: Int64 = 1
    prompt: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: Int64 = 0
    topk_sample_logprobs: Int64 = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: Int64 = 0
    prompt_logprobs_last_n: Int64 | None = None
    record_stability_info: bool = False
    base_model: str | None = None
    model_path: str | None = None


class RetrieveFutureRequest(BaseModel):
    request_id: str
    allow_metadata_only: bool = False


class ProjectRequest(BaseModel):
    project_id: str | None = None


class SaveWeightsExternalRequest(BaseModel):
    model_id: str
    path: str
    seq_id: Int64 | None = None
    ttl_seconds: Int64 | None = None
    age_encryption_recipients: list[Annotated[str, Field(max_length=4096)]] | None = Field(None, max_length=64)


class TtlRequest(BaseModel):
    ttl_seconds: Int64 | None = None
