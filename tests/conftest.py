"""Test-wide setup and tiny-model fixtures.

Simulated CPU devices must be configured before JAX initialises, so this runs first. Models are
built offline from a `transformers` config with random weights; each distinct spec is built once
per session so its shapes compile once.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Tiny models spend their test time compiling, not running. On CPU, LLVM's cheapest code generation cuts a
# parity module's time by about 30%, and XLA's classic loop emitters instead of its fusion emitters about
# 30% more (float32 results stay IEEE either way). Servers and benchmarks the tests start inherit this;
# benchmarks/ run by hand do not. The device check's GPU tests keep the defaults.
CHEAP_CPU_COMPILES = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    for flag in CHEAP_CPU_COMPILES:
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag
# One persistent compile cache for the whole run, made by the process pytest starts in and inherited by its
# xdist workers and every server, benchmark or script a test starts: the same tiny programs compile in many
# tests and processes (a warm cache took a qwen3.5-tiny training benchmark from 35 s to 15 s). A hit still
# counts as a compile (`tx.engine.compiles`), so compile-count assertions read the same; a cache entry is
# the program XLA built, so results do too. Removed when the run ends; a developer's own directory is kept.
OWN_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWN_COMPILE_CACHE:
    import tempfile
    import uuid

    os.environ["JAX_COMPILATION_CACHE_DIR"] = f"{tempfile.gettempdir()}/smolgym-test-compiles-{uuid.uuid4().hex[:12]}"
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")  # below it a write costs what it saves
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def build_hf_model(path: Path, family: str = "qwen3", kv_heads: int = 2, tied: bool = True, seed: int = 0, **extra):
    """A tiny random-weight transformers model saved to `path`; returns the torch model (eval, fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(**{**TINY, **extra}, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so a misplaced norm shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory):
    """get(family, kv_heads, tied, rope) -> (model dir, torch model), built once per session."""
    cache: dict[tuple, tuple[Path, Any]] = {}

    def get(family: str = "qwen3", kv_heads: int = 2, tied: bool = True, rope: str = "default"):
        key = (family, kv_heads, tied, rope)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-kv{kv_heads}-{'tied' if tied else 'untied'}-{rope}")
            extra = {"rope_parameters": LLAMA3_ROPE} if rope == "llama3" else {}
            cache[key] = (path, build_hf_model(path, family, kv_heads, tied, **extra))
        return cache[key]

    return get


# A tiny Qwen3.5: eight layers in the released 3 linear + 1 full pattern, DeltaNet heads of both kinds.
QWEN3_5_TEXT: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=256,
    initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
QWEN3_5_VISION: dict[str, Any] = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4
)


def build_qwen3_5(path: Path, multimodal: bool, tied: bool = False, **text_extra: Any):
    """A tiny random Qwen3.5 saved to `path`: the hub's multimodal class (with its vision tower) or the
    text-only one. Returns the torch model (eval, fp32)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(0)
    text = {**QWEN3_5_TEXT, **text_extra, "tie_word_embeddings": tied}
    if multimodal:
        config = Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VISION, tie_word_embeddings=tied)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    with torch.no_grad():  # norms start at 0 (zero-centred) or 1: perturb them, and the gating, to see misplacements
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    return model


GPT_OSS: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    swiglu_limit=0.6,
    max_position_embeddings=256,
    # YaRN whose ramp between kept and interpolated frequencies falls inside the 8 frequencies of a head
    rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=4.0, beta_slow=0.5, truncate=False,
        original_max_position_embeddings=32,
    ),
)  # fmt: skip


def build_gpt_oss(path: Path, seed: int = 0):
    """A tiny random gpt-oss saved to `path`; returns the torch model. transformers initialises biases and
    norms to constants and sinks near 0: all are randomised so that each shows up; the experts' weights are
    scaled so that the clamp at `swiglu_limit` is reached."""
    import torch
    import transformers
    from transformers import GptOssConfig, GptOssForCausalLM

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 18):
        pytest.skip("transformers < 5.18 hard-codes gpt-oss's swiglu_limit (7.0): no reference for this model")
    torch.manual_seed(seed)
    ref = GptOssForCausalLM(GptOssConfig(**GPT_OSS)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")) or "router" in name:
                p.normal_(0.0, 1.0 if ("sinks" in name or "router" in name) else 0.1)
            elif "experts" in name:
                p.normal_(0.0, 0.3)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="session", autouse=True)
def _sdk_heartbeats_end_with_the_suite():
    """A tinker SDK client that a test does not close keeps a heartbeat on the SDK's daemon thread, which
    logs to stderr every 10 s once its server is gone; a daemon thread writing while the interpreter shuts
    down can abort the process after every test has passed. Torn down last: stop every client left open
    (local cleanup only, no request to a server that may be gone)."""
    yield
    import gc
    import sys

    if "tinker" not in sys.modules:  # no SDK client was made (or the SDK is not installed: the device check)
        return
    from tinker.lib.internal_client_holder import InternalClientHolder

    for holder in [obj for obj in gc.get_objects() if isinstance(obj, InternalClientHolder)]:
        if holder._begin_close():
            holder.run_coroutine_threadsafe(holder._async_cleanup()).result(timeout=30)


def pytest_unconfigure(config: pytest.Config) -> None:
    """pytest turns its faulthandler off here; keep one on through interpreter shutdown, so a crash after
    the summary prints every thread's stack instead of a bare exit code."""
    import faulthandler
    import shutil
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    if OWN_COMPILE_CACHE and not hasattr(config, "workerinput"):  # the process that made it, after its workers
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
