"""bfloat16 compute against the float32 reference: the dtype path accelerators run (`--dtype auto` is
bfloat16 there), checked on CPU with stated tolerances.

Both models load the same tiny checkpoint (wide initialiser, so logits are spread); the bfloat16 one keeps
bfloat16 weights and activations, fp32 adapter masters cast to bfloat16 at use, fp32 logits. bfloat16
keeps 8 bits of mantissa (relative rounding 2^-9 ~ 0.2%) and the error grows through the residual stream,
so the bounds are relative norms ||bf16 - fp32|| / ||fp32|| and absolute log-probability differences, set
at about 1.5x what was measured here. For scale: transformers' own bfloat16 forward of this checkpoint is
off its float32 forward by 1.8% (logits, relative norm) and 0.30 nats at most (log-probabilities); ours by
1.7% and 0.26 nats, the LoRA gradients by at most 3.6%, the greedy decode picked the same 12 tokens and
reported log-probabilities within 0.07 nats. Each test runs with the CPU tuning and the plain
(accelerator) one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_hf_model
from flax import nnx

from tx.engine.bank import AdapterBank
from tx.engine.sampler import Sampler, SamplerConfig
from tx.engine.train_step import flat
from tx.engine.trainer import Trainer
from tx.lora.layers import LoRASpec
from tx.lora.params import AdapterRoles
from tx.models.causal_lm import decode_layout
from tx.models.weights import load_model
from tx.protocol import Datum, ForwardBackwardRequest, LoraConfig, SampleRequest, SamplingParams
from tx.tuning import CPU, for_backend

LOGIT_REL = 2.5e-2  # relative norm of the logits' error
LOGPROB_ABS = 0.4  # nats, any token at any position
ARGMAX_AGREE = 0.85  # fraction of positions whose most likely token is the same
GRAD_REL = 5e-2  # relative norm of each LoRA gradient's error
DECODE_LOGPROB_ABS = 0.15  # nats: the sampled tokens' logprobs (measured 0.07)
GREEDY_MARGIN = 0.15  # nats: a bf16 greedy token is at most this far below the fp32 best at its position

TUNINGS = [CPU, for_backend("gpu")]
TOKENS = np.random.RandomState(3).randint(0, 256, (2, 40))


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-bf16")
    build_hf_model(path, "qwen3", 2, False, initializer_range=0.3)
    return path


@dataclasses.dataclass
class Pair:
    fp32: nnx.Module
    bf16: nnx.Module
    tuning: object


@pytest.fixture(scope="module", params=TUNINGS, ids=lambda t: t.backend)
def pair(checkpoint, request) -> Pair:
    spec = LoRASpec(2, 8, request.param.lora_kernel)
    load = {"lora": spec, "tuning": request.param, "progress": False}
    fp32, _ = load_model(str(checkpoint), dtype="float32", **load)
    bf16, cfg = load_model(str(checkpoint), dtype="bfloat16", **load)
    assert cfg.dtype == "bfloat16" and bf16.model.layers.mlp.up_proj.weight[...].dtype == jnp.bfloat16
    return Pair(fp32, bf16, request.param)


def logprobs(model: nnx.Module, tokens: np.ndarray) -> np.ndarray:
    logits, _ = model(jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


@pytest.mark.parity
def test_forward_logits_and_logprobs(pair):
    want_logits, _ = pair.fp32(jnp.asarray(TOKENS))
    got_logits, _ = pair.bf16(jnp.asarray(TOKENS))
    assert relative(np.asarray(got_logits), np.asarray(want_logits)) < LOGIT_REL
    got, want = logprobs(pair.bf16, TOKENS), logprobs(pair.fp32, TOKENS)
    assert np.all(np.isfinite(got)) and np.abs(got - want).max() < LOGPROB_ABS
    assert (got.argmax(-1) == want.argmax(-1)).mean() > ARGMAX_AGREE


def lora_gradients(model: nnx.Module) -> dict:
    trainer = Trainer(model, AdapterBank.of(model))
    run = trainer.create_lora_run("run", LoraConfig(rank=8), slot=1)
    init = np.random.RandomState(1)
    trainer.set_run_params(
        run, {p: init.normal(0, 0.1, v.shape).astype(np.float32) for p, v in trainer.run_params(run).items()}
    )
    data = [Datum(row[:-1].tolist(), {"target_tokens": row[1:]}) for row in TOKENS]
    trainer.forward_backward([("run", ForwardBackwardRequest(data, "cross_entropy"))])
    return {p: np.asarray(g) for p, g in run.grads.items()}


@pytest.mark.parity
def test_lora_gradient(pair):
    want, got = lora_gradients(pair.fp32), lora_gradients(pair.bf16)
    assert want.keys() == got.keys()
    for path, g in want.items():
        assert got[path].dtype == np.float32  # fp32 masters, fp32 accumulators
        assert relative(got[path], g) < GRAD_REL, path


def greedy(model: nnx.Module, tuning, prompt: list[int], n: int) -> list[float]:
    graphdef, state = nnx.split(model)
    weights = decode_layout(flat(state), tuning, adapters=AdapterRoles.of(state))
    cfg = SamplerConfig(
        max_rows=2, max_seq_len=64, chunk_steps=4, length_buckets=(64,), layer_cache=tuning.per_layer_decode
    )
    sampler = Sampler(graphdef, lambda: weights, model.config, cfg, (), lambda ids: "", None)
    params = SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False)
    sampler.submit("g", SampleRequest(prompt, 1, params, "base"), 0)
    while not sampler.idle():
        out = dict(sampler.step())
    return out["g"].sequences[0]


@pytest.mark.parity
def test_short_greedy_decode(pair):
    """Every token of a bf16 greedy decode is (within the margin) the fp32 model's best at its position,
    teacher-forced on the bf16 continuation; the logprobs the bf16 sampler reports match fp32's."""
    prompt, n = TOKENS[0, :8].tolist(), 12
    seq = greedy(pair.bf16, pair.tuning, prompt, n)
    ref = logprobs(pair.fp32, np.asarray([prompt + seq.tokens]))[0, len(prompt) - 1 : -1]  # [n, V]
    chosen = ref[np.arange(n), seq.tokens]
    assert np.all(ref.max(-1) - chosen < GREEDY_MARGIN)
    np.testing.assert_allclose(seq.logprobs, chosen, atol=DECODE_LOGPROB_ABS)
