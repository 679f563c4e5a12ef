"""Model configuration we own, built from a Hugging Face `config.json` at the edge and validated.

`ModelConfig` is frozen and family-neutral: the registry maps the HF `architectures` entry to a family
(which only decides details such as Qwen3's per-head q/k norms). Anything we cannot run faithfully is
rejected here, with the field that caused it, rather than silently approximated. Hybrid families
(Qwen3.5 / Qwen3.6, `qwen3_5`) add `layer_types` and a `LinearAttention` section; their parsing lives in
`tx.models.config_qwen3_5`, which reads every field of the HF file and rejects the ones it does not know.
Mixture-of-experts families (Qwen3-MoE, `qwen3_moe`; Qwen3.5-MoE, `qwen3_5_moe`; gpt-oss, `gpt_oss`) add a
`MoE` section, parsed the same way in `tx.models.config_qwen3_moe`, `tx.models.config_qwen3_5` and
`tx.models.config_gpt_oss`; gpt-oss also sets the attention extras (biases, learned sinks, sliding-window
layers) and YaRN rotary scaling. Rotary scaling, read as transformers reads it, is `tx.models.config_rope`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from tx.models.config_rope import RopeScaling, rope_params, rope_scaling_of

# HF architecture name -> family name.
ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers' shape (`linear_*` fields of a Qwen3.5 config): key/query heads of
    `key_head_dim`, value heads of `value_head_dim` (each key head serves value_heads / key_heads of
    them), and the depthwise causal convolution's kernel width over the concatenated q, k, v channels."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"linear attention {f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.key_heads})"
            )

    @property
    def conv_dim(self) -> int:
        """Channels of `in_proj_qkv` and the convolution: q and k (key heads) then v (value heads)."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # DeltaNet + gated attention layers (`tx.models.qwen3_5`)
DENSE_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")  # a dense layer's MLP, directly under `mlp`


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped above and up on both sides at `limit`, then
    `(up + 1) * gate * sigmoid(alpha * gate)`."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if self.limit <= 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.limit}")


@dataclasses.dataclass(frozen=True)
class MoE:
    """The sparse MLP's shape: each token's `top_k` of `experts` routed experts (SwiGLU MLPs of width
    `expert_size`), weighted by the router's softmax probabilities, renormalised over the chosen ones
    when `norm_topk_prob`; `shared_expert_size` > 0 adds a dense expert behind a sigmoid gate
    (Qwen3.5-MoE). `sparse_layers`: the layers whose MLP is this block (the others are dense).
    gpt-oss (`gpt_oss`): the router and the experts have biases, the top-k logits are picked first and
    softmaxed among themselves, gate and up are one interleaved projection (`gate_up_proj`, gate in the
    even rows) and the activation is the `ClampedSwiGLU`."""

    experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0
    gpt_oss: ClampedSwiGLU | None = None

    def __post_init__(self) -> None:
        if self.experts < 1 or self.expert_size < 1:
            raise ValueError(
                f"num_experts ({self.experts}) and moe_intermediate_size ({self.expert_size}) must be >= 1"
            )
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.experts}), got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; () = every layer full attention
    linear: LinearAttention | None = None  # set when any layer is linear attention
    partial_rotary_factor: float = 1.0  # the leading fraction of each head's dims that rotary rotates
    checkpoint_prefix: str = "model"  # where the text model's tensors live ("model.language_model": multimodal)
    moe: MoE | None = None  # set for mixture-of-experts families
    attention_bias: bool = False  # q/k/v/o projections have biases (gpt-oss)
    attention_sinks: bool = False  # one learned logit per head joins each softmax, its value 0 (gpt-oss)
    sliding_window: int = 0  # the layers in `sliding_layers` see their last `sliding_window` positions only
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in ARCHITECTURES.values():
            raise ValueError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        self._check_layer_types()
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ValueError(f"a moe section goes with the {MOE_FAMILIES} families only, not {self.family!r}")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.sparse_layers):
            raise ValueError(f"sparse layers {self.moe.sparse_layers} outside 0..{self.num_layers - 1}")
        if self.dense_mlp_layers and self.family != "qwen3_moe":
            raise ValueError(f"dense MLP layers go with qwen3_moe only, not {self.family!r}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or (
            bool(self.sliding_layers) != (self.sliding_window > 0)
        ):
            raise ValueError(f"sliding layers {self.sliding_layers} with window {self.sliding_window}")
        if (self.attention_bias or self.attention_sinks) and self.family != "gpt_oss":
            raise ValueError(f"attention biases and sinks go with gpt_oss only, not {self.family!r}")

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: {LAYER_TYPES}")
        if ("linear_attention" in self.layer_types) != (self.linear is not None):
            raise ValueError("linear attention layers need the linear_* fields, and only they do")
        if self.family not in HYBRID_FAMILIES:
            raise ValueError(f"layer_types are only supported for the {HYBRID_FAMILIES} families, not {self.family!r}")

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe", *HYBRID_FAMILIES)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every layer's type, `full_attention` where the config lists none."""
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        """The layers of a MoE model whose MLP is dense (Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`)."""
        return () if self.moe is None else tuple(i for i in range(self.num_layers) if i not in self.moe.sparse_layers)

    def layers_holding(self, module: str, part: str = "") -> tuple[int, ...]:
        """The HF layer indices, in order, whose weights a stacked decoder sub-module holds: Qwen3.5's
        `linear_attn` and `self_attn` are stacked over the layers of their own type only; in a MoE model
        with dense layers `mlp`'s own projections (`part` gate_proj, up_proj, down_proj) over the dense
        layers, its router and experts over the sparse ones."""
        if module == "mlp" and self.moe is not None:
            return self.dense_mlp_layers if part in DENSE_MLP_PARTS else self.moe.sparse_layers
        kind = {"linear_attn": "linear_attention", "self_attn": "full_attention"}.get(module)
        return tuple(i for i, t in enumerate(self.kinds) if kind is None or t == kind)

    def stacked_layer(self, path: tuple[str, ...], index: int) -> int:
        """The model layer that entry `index` of the stacked decoder weight or module at `path`
        (`("model", "layers", "mlp", "experts", ...)`) belongs to."""
        return self.layers_holding(*path[2:4])[index]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
        """The config of a parsed config.json; `ValueError` naming the field when it is not one we build
        (an uploaded config is a client's: zero heads or a rotary base past float range included)."""
        try:
            return ModelConfig._from_hf(hf, dtype)
        except ZeroDivisionError:
            raise ValueError("config.json: num_attention_heads and the other head counts must be >= 1") from None
        except OverflowError as err:
            raise ValueError(f"config.json has a number too large for its field ({err})") from None

    @staticmethod
    def _from_hf(hf: dict[str, Any], dtype: str | None) -> ModelConfig:
        family = family_of(hf)
        _check_whole_numbers(hf)
        if family in HYBRID_FAMILIES:
            from tx.models.config_qwen3_5 import qwen3_5_from_hf  # that module builds a ModelConfig

            return qwen3_5_from_hf(hf, dtype)
        if family == "qwen3_moe":
            from tx.models.config_qwen3_moe import qwen3_moe_from_hf  # that module builds a ModelConfig

            return qwen3_moe_from_hf(hf, dtype)
        if family == "gpt_oss":
            from tx.models.config_gpt_oss import gpt_oss_from_hf  # that module builds a ModelConfig

            return gpt_oss_from_hf(hf, dtype)
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"config.json sets {flag}=true, which SmolGym does not support")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true, which SmolGym does not support")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        return ModelConfig(
            family=family,
            intermediate_size=int(hf["intermediate_size"]),
            **transformer_shape(hf, eps=1e-6, theta=10000.0, max_positions=4096),
            rope_scaling=rope_scaling_of(hf, 4096),
            dtype=dtype or _dtype_of(hf),
        )


def transformer_shape(hf: dict[str, Any], *, eps: float, theta: float, max_positions: int) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads the same way from `config.json` (sizes, heads, norm
    epsilon, rotary base, context, tied embeddings); the keyword arguments are the family's defaults."""
    heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", eps)),
        rope_theta=float(rope_params(hf).get("rope_theta", hf.get("rope_theta", theta))),
        max_position_embeddings=int(hf.get("max_position_embeddings", max_positions)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


# The config.json fields read as integers (the text model's own section too): 2.5 layers is an error, not 2.
WHOLE_FIELDS = frozenset(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "max_position_embeddings num_experts num_local_experts num_experts_per_tok experts_per_token "
    "moe_intermediate_size shared_expert_intermediate_size decoder_sparse_step full_attention_interval "
    "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim linear_conv_kernel_dim "
    "sliding_window".split()
)


# Upper bounds, checked before anything is built from a config (a per-layer table of 10^6 layers took hours to
# check and 10^10 exhausted memory; a 2^26 vocabulary made a 19 GB adapter bank): far past any published model.
WHOLE_LIMITS = {"num_hidden_layers": 1024, "vocab_size": 1 << 22}
WHOLE_LIMIT = 1 << 31  # any other field: an int32 dimension


def _check_whole_numbers(hf: dict[str, Any]) -> None:
    text = hf.get("text_config")
    for section in (hf, text if isinstance(text, dict) else {}):
        for key in WHOLE_FIELDS & section.keys():
            value = section[key]
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if value is not None and (isinstance(value, bool) or not whole):
                raise ValueError(f"config.json {key} must be a whole number, got {value!r}")
            if value is not None and value > (limit := WHOLE_LIMITS.get(key, WHOLE_LIMIT)):
                raise ValueError(f"config.json {key} must be at most {limit}, got {value}")


def family_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        named = [a for a, family in ARCHITECTURES.items() if family == hf.get("model_type")]
        hint = f', e.g. "architectures": ["{named[0]}"]' if named else ""
        raise ValueError(
            f"config.json names no architectures (model_type {hf.get('model_type')!r}); add its class{hint}"
        )
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')}; supported: {sorted(ARCHITECTURES)}")


def _dtype_of(hf: dict[str, Any]) -> str:
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return "bfloat16" if "bfloat16" in name else "float32"


def load_hf_config(model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
    try:
        hf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} is not a JSON object")
    return ModelConfig.from_hf(hf, dtype=dtype)
