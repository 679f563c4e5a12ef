"""Import and export LoRA adapters in Hugging Face PEFT's on-disk format, framework-neutral.

An adapter is an `AdapterConfig` plus `AdapterWeights`: a dict from the base model's HF module name
("model.layers.3.self_attn.q_proj", "lm_head") to float32 `(A [in, R], B [R, out])`, so that the
module's weight (HF `[out, in]` layout) changes by `scaling * (A @ B).T`. PEFT stores the same
factors transposed (`lora_A.weight [R, in]`, `lora_B.weight [out, R]`) under
`base_model.model.<module>.lora_{A,B}.weight`. The engine converts its stacked device arrays to and
from this structure; nothing here knows about JAX.

Invariants: every module in an `AdapterWeights` shares one rank and one scaling. `load_peft`
accepts adapters trained elsewhere with per-module ranks (`rank_pattern`) or alphas
(`alpha_pattern`) by zero-padding each pair to the largest rank and folding the module's own
scaling into B, which keeps every delta exact (zero rows/columns also stay zero under gradient
descent, since each one's gradient is multiplied by its zero partner). Anything PEFT can express
that a plain LoRA on our targets cannot (DoRA, biases, modules_to_save, embedding LoRA, `target_parameters`
other than a MoE block's fused experts) is refused with an error that names it. Fused expert adapters are
read, and optionally written, by `tx.lora.peft_experts`. Writes are atomic: a directory either holds a
whole adapter or nothing.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tx.lora import peft_experts
from tx.lora.targets import ALL

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
SUPPORTED_TARGETS = ALL

# PEFT wraps the HF model twice (PeftModel.base_model = LoraModel, LoraModel.model = HF model).
_PREFIX = "base_model.model."
# lora_A / lora_B, with an optional adapter name (".default") that PEFT strips when saving.
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """The adapter hyper-parameters that matter for the weights: one rank and one scaling for all modules."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model_name_or_path: str
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unsupported = sorted(set(self.target_modules) - set(SUPPORTED_TARGETS))
        if unsupported:
            raise ValueError(f"unsupported LoRA target modules {unsupported}; supported: {list(SUPPORTED_TARGETS)}")

    @property
    def scaling(self) -> float:
        return _scaling(self.alpha, self.rank, self.use_rslora)


AdapterWeights = dict[str, tuple[np.ndarray, np.ndarray]]


def _scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def lora_delta(config: AdapterConfig, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The float32 weight change `[out, in]` (HF layout) of one module; extra padded rank is ignored."""
    a32 = np.asarray(a, np.float32)[:, : config.rank]
    b32 = np.asarray(b, np.float32)[: config.rank, :]
    return np.float32(config.scaling) * (a32 @ b32).T


# ----------------------------------------------------------------------------------------------- save


def save_peft(
    path: str | os.PathLike[str],
    config: AdapterConfig,
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]],
    fused_experts: bool = False,
) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` to directory `path`, replacing it atomically.

    Weights may carry a padded rank larger than `config.rank`; only the first `config.rank` components are kept.
    `fused_experts`: write a MoE block's expert adapters in PEFT's `target_parameters` form
    (`tx.lora.peft_experts`) instead of one module per expert.
    """
    tensors: dict[str, np.ndarray] = {}
    extra: dict[str, Any] = {}
    if fused_experts:
        split = not any(name.endswith(".gate_up_proj") for name in weights)  # gpt-oss holds gate_up fused
        weights, stored = peft_experts.fuse(weights, config.rank)
        for module, (lora_a, lora_b) in stored.items():
            tensors[f"{_PREFIX}{module}.lora_A.weight"], tensors[f"{_PREFIX}{module}.lora_B.weight"] = lora_a, lora_b
        extra = peft_experts.fused_config(config.rank, config.alpha, split) if stored else {}
    for module, (a, b) in sorted(weights.items()):
        _check_pair(config, module, a, b)
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
            np.asarray(a, np.float32)[:, : config.rank].T
        )
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(
            np.asarray(b, np.float32)[: config.rank, :].T
        )
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        fields = {**_peft_config_json(config), **extra}
        (tmp / CONFIG_NAME).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _short(module: str) -> str:
    """The short module name a target names: `model.layers.0.self_attn.q_proj` -> `q_proj`."""
    return module.rpartition(".")[2]


def _check_pair(config: AdapterConfig, module: str, a: np.ndarray, b: np.ndarray) -> None:
    short = _short(module)
    if short not in config.target_modules:
        raise ValueError(f"module {module!r} is not in target_modules {list(config.target_modules)}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.shape[1] < config.rank:
        raise ValueError(f"{module}: A {a.shape} and B {b.shape} are not [in, R] and [R, out] with R >= {config.rank}")


def _peft_config_json(config: AdapterConfig) -> dict[str, Any]:
    # The fields PEFT (0.15 through current) reads for LoRA; omitted ones take PEFT's defaults, and writing no
    # version-specific fields keeps older PEFT and vLLM from warning about unknown keys.
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": alpha,
        "target_modules": list(config.target_modules),
        "base_model_name_or_path": config.base_model_name_or_path,
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory next to `path`; on success it replaces `path`, on error it vanishes.

    Files are fsynced before the rename so that a crash leaves either the old directory or the new whole one.
    An existing `path` is moved aside before the new one is renamed in, then deleted.
    """
    dest = Path(path).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.rename(dest, old / dest.name)
        os.rename(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    for file in root.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------- load


def load_peft(path: str | os.PathLike[str], fused_gate_up: bool = False) -> tuple[AdapterConfig, AdapterWeights]:
    """Read a PEFT LoRA adapter directory (ours or HF PEFT's) into one rank and one scaling. `fused_gate_up`:
    the model holds its experts' gate and up as one projection (gpt-oss), so fused expert adapters stay so.

    `target_modules` is resolved from the weights present (so regex strings and `layers_to_transform` need no
    model). Per-module ranks and alphas are zero-padded / folded into B as the module docstring explains; the
    returned rank is the largest one and alpha is the file's `lora_alpha`.
    """
    root = Path(path)
    raw = json.loads((root / CONFIG_NAME).read_text())
    _check_config(raw)
    pairs = _read_pairs(root, raw, fused_gate_up)
    return _uniform(raw, pairs)


def _check_config(raw: Mapping[str, Any]) -> None:
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"only LoRA adapters are supported, got peft_type={raw.get('peft_type')!r}")
    refusals = {
        "use_dora": "DoRA (use_dora=true) adapters are not supported",
        "modules_to_save": "modules_to_save={} is not supported: fully trained modules cannot be served as LoRA",
        "lora_bias": "LoRA biases (lora_bias=true) are not supported",
        "fan_in_fan_out": "fan_in_fan_out=true (Conv1D-style weights) is not supported",
        "trainable_token_indices": "trainable_token_indices={} (embedding updates) is not supported",
        "layer_replication": "layer_replication={} is not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens={}) is not supported",
    }
    for field, message in refusals.items():
        if raw.get(field):
            raise ValueError(message.format(raw[field]))
    fused = set(raw.get("target_parameters") or ())
    if fused - set(peft_experts.TARGET_PARAMETERS):
        raise ValueError(
            f"target_parameters={sorted(fused)} is not supported; only a MoE block's fused experts "
            f"{peft_experts.TARGET_PARAMETERS} are"
        )
    if raw.get("bias", "none") != "none":
        raise ValueError(f"bias={raw['bias']!r} is not supported; only bias='none' adapters can be loaded")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        _check_short_names({_short(t) for t in targets}, "target_modules")


def _check_short_names(names: set[str], where: str) -> None:
    unsupported = sorted(names - set(SUPPORTED_TARGETS))
    if unsupported:
        raise ValueError(f"{where} has unsupported LoRA targets {unsupported}; supported: {list(SUPPORTED_TARGETS)}")


def _read_pairs(
    root: Path, raw: Mapping[str, Any], fused_gate_up: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Module name → (lora_A.weight [r, in], lora_B.weight [out, r]) as stored (fused experts split per
    expert), after checking every key."""
    file = root / WEIGHTS_NAME
    if not file.exists():
        if (root / "adapter_model.bin").exists():
            raise ValueError(
                f"{root} holds adapter_model.bin (a torch pickle); convert it to adapter_model.safetensors, e.g. "
                "PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True)"
            )
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {root}")
    found: dict[str, dict[str, np.ndarray]] = {}
    adapter_names = set()
    # safe_open rather than load_file: PEFT may have saved full embedding copies we skip without reading.
    with safe_open(str(file), framework="numpy") as f:
        for key in f.keys():
            name = key.removeprefix(_PREFIX)
            match = _LORA_KEY.match(name)
            if match is None:
                _check_other_key(name)
                continue
            adapter_names.add(match["adapter"])
            found.setdefault(match["module"], {})[match["kind"]] = f.get_tensor(key)
    if len(adapter_names) > 1:
        raise ValueError(f"{file} holds several adapters {sorted(map(str, adapter_names))}; save them separately")
    incomplete = sorted(m for m, kinds in found.items() if len(kinds) != 2)
    if incomplete:
        raise ValueError(f"{file}: modules {incomplete} lack lora_A or lora_B")
    pairs = {m: (kinds["lora_A"], kinds["lora_B"]) for m, kinds in found.items()}
    if raw.get("target_parameters"):
        pairs = peft_experts.unfuse(pairs, raw, fused_gate_up)
    _check_short_names({_short(m) for m in pairs}, str(file))
    return pairs


def _check_other_key(name: str) -> None:
    if "lora_magnitude_vector" in name:
        raise ValueError(f"DoRA weights ({name}) are not supported")
    if "lora_embedding_" in name:
        raise ValueError(f"LoRA on embeddings ({name}) is not supported; supported targets: {list(SUPPORTED_TARGETS)}")
    if ".lora_A." in name or ".lora_B." in name:
        raise ValueError(f"LoRA biases ({name}) are not supported")
    if "modules_to_save" in name:
        raise ValueError(f"modules_to_save weights ({name}) are not supported")
    # PEFT also saves full copies of the base embedding / lm_head when they are LoRA targets or were resized
    # ("save_embedding_layers"). They duplicate the base model we serve against, so they carry nothing to import.
    if name.endswith(".base_layer.weight") or name.rsplit(".", 2)[-2:] in (
        ["embed_tokens", "weight"],
        ["lm_head", "weight"],
    ):
        return
    raise ValueError(f"unexpected tensor {name!r} in a LoRA adapter")


def _uniform(
    raw: Mapping[str, Any], pairs: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> tuple[AdapterConfig, AdapterWeights]:
    if not pairs:
        raise ValueError("the adapter holds no lora_A/lora_B weights")
    use_rslora = bool(raw.get("use_rslora", False))
    alpha = float(raw["lora_alpha"])
    rank_pattern: dict[str, int] = raw.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = raw.get("alpha_pattern") or {}
    rank = max(a.shape[0] for a, _ in pairs.values())
    scaling = _scaling(alpha, rank, use_rslora)
    weights: AdapterWeights = {}
    for module, (lora_a, lora_b) in sorted(pairs.items()):
        r = lora_a.shape[0]
        if lora_b.shape[1] != r:
            raise ValueError(f"{module}: lora_A {lora_a.shape} and lora_B {lora_b.shape} disagree on rank")
        expected_r = int(_pattern_value(rank_pattern, module, raw.get("r", r)))
        if expected_r != r:
            raise ValueError(f"{module}: weights have rank {r} but the config says {expected_r}")
        own = _scaling(float(_pattern_value(alpha_pattern, module, alpha)), r, use_rslora)
        a = np.zeros((lora_a.shape[1], rank), np.float32)
        b = np.zeros((rank, lora_b.shape[0]), np.float32)
        a[:, :r] = lora_a.T
        b[:r, :] = lora_b.T
        if own != scaling:
            b *= np.float32(own / scaling)
        weights[module] = (a, b)
    present = {_short(m) for m in weights}
    config = AdapterConfig(
        rank=rank,
        alpha=alpha,
        target_modules=tuple(t for t in SUPPORTED_TARGETS if t in present),
        base_model_name_or_path=raw.get("base_model_name_or_path") or "",
        use_rslora=use_rslora,
    )
    return config, weights


def _pattern_value(pattern: Mapping[str, Any], module: str, default: Any) -> Any:
    # Same rule as PEFT: the first pattern key that matches a dotted suffix of the module name wins.
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
