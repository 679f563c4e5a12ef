"""The continuous-batching sampler on Qwen3.5 (Gated DeltaNet + full attention) against transformers and
against our own teacher-forced forward pass.

A decode row carries the DeltaNet layers' recurrent state beside the full layers' keys and values; these
tests cover what that adds: rows handed to a new occupant start from an empty state, a prompt's state is
shared by its samples and kept by the prompt cache, and padding in a prefill batch leaves it alone.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from adapter_view import FixedAdapters
from conftest import build_qwen3_5
from flax import nnx

from tx.engine.sampler import Sampler, SamplerConfig
from tx.engine.train_step import flat
from tx.lora.layers import LoRASpec
from tx.lora.params import AdapterRoles, LoRAParam, LoRARows, slot_scale
from tx.models.cache import HybridCache
from tx.models.causal_lm import decode_layout
from tx.models.weights import load_model
from tx.protocol import SampleRequest, SamplingParams
from tx.tuning import CPU

CFG = SamplerConfig(max_rows=4, max_seq_len=64, chunk_steps=4, length_buckets=(32, 64), prompt_cache_bytes=1 << 20)
SLOT = 1


class Setup:
    def __init__(self, path) -> None:
        self.hf = build_qwen3_5(path, multimodal=True, initializer_range=0.3)
        self.hf.generation_config.eos_token_id = None
        self.model, self.cfg = load_model(str(path), lora=LoRASpec(slots=2, max_rank=4), progress=False)
        lora = nnx.state(self.model, LoRAParam)
        keys = iter(jax.random.split(jax.random.key(1), 128))
        nnx.update(self.model, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape), lora))
        one = slot_scale(4, 8.0, 4)
        self.scale = jnp.stack([jnp.zeros_like(one), one])
        roles = AdapterRoles.of(lora)
        self.graphdef, self.state = nnx.split(self.model)
        # The engine's CPU form: base weights split into per-layer buffers, layers unrolled over them (the
        # stacked form is checked against transformers in tests/models/test_qwen3_5.py).
        weights = decode_layout(flat(self.state), CPU, adapters=roles)
        self.sampler = Sampler(
            self.graphdef, lambda: weights, self.cfg, CFG, (), lambda ids: "",
            FixedAdapters(lambda: self.scale, lambda: 0, roles=roles),
        )  # fmt: skip

    def logprobs(self, tokens: list[int], slot: int = 0) -> np.ndarray:
        """Teacher-forced log_softmax [T, V] of the full forward pass (one jitted shape)."""
        padded = np.zeros((1, CFG.max_seq_len), np.int32)
        padded[0, : len(tokens)] = tokens
        return np.asarray(self._forward(self.state, padded, jnp.array([slot], jnp.int32)))[0, : len(tokens)]

    @functools.partial(jax.jit, static_argnums=0)
    def _forward(self, state: nnx.State, tokens: jax.Array, slot: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(self.graphdef, state)(tokens, rows=LoRARows(slot, self.scale))
        return jax.nn.log_softmax(logits, axis=-1)

    def greedy(self, prompt: list[int], n: int, slot: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(np.argmax(self.logprobs(tokens, slot)[-1])))
        return tokens[len(prompt) :]

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def q35(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("qwen3_5-sampler"))


def req(prompt: list[int], max_tokens: int, n: int = 1, **params) -> SampleRequest:
    return SampleRequest(list(prompt), n, SamplingParams(max_tokens=max_tokens, stop_at_eos=False, **params), "base")


def drain(sampler: Sampler, results: dict) -> None:
    while not sampler.idle():
        results.update(sampler.step())


def tokens(result) -> list[list[int]]:
    return [seq.tokens for seq in result.sequences]


@pytest.mark.parity
def test_greedy_equals_transformers_generate_with_rows_reused_mid_batch(q35):
    """A short request leaves its row while a long one decodes; the next request (a one-token prompt,
    so nothing is prefilled into the row) takes that row and must not read its predecessor's state."""
    sampler, results = q35.sampler, {}
    sampler.submit("long", req([3, 1, 4, 1, 5, 9, 2, 6], 24, temperature=0.0), 0)
    sampler.submit("short", req(list(range(10, 31)), 4, n=2, temperature=0.0), 0)
    while "short" not in results:
        results.update(sampler.step())
    assert sampler.cache_shape is not None and not sampler.idle(), "the long request still holds its row"
    sampler.submit("one", req([7], 10, temperature=0.0), 0)
    sampler.submit("padded", req([8, 9, 10], 10, temperature=0.0), 0)  # prefilled beside a longer prompt's bucket
    drain(sampler, results)
    assert tokens(results["long"]) == [q35.hf_greedy([3, 1, 4, 1, 5, 9, 2, 6], 24)]
    assert tokens(results["short"]) == [q35.hf_greedy(list(range(10, 31)), 4)] * 2
    assert tokens(results["one"]) == [q35.hf_greedy([7], 10)]
    assert tokens(results["padded"]) == [q35.hf_greedy([8, 9, 10], 10)]


def test_adapter_rows_and_sampled_logprobs_match_teacher_forcing(q35):
    prompt = [5, 9, 40, 41, 60, 3, 8]
    results: dict = {}
    q35.sampler.submit("lora", req(prompt, 12, temperature=0.0), SLOT)
    q35.sampler.submit("sampled", req(prompt, 16, n=2, temperature=1.0, seed=3), SLOT)
    drain(q35.sampler, results)
    assert tokens(results["lora"]) == [q35.greedy(prompt, 12, SLOT)]
    assert tokens(results["lora"])[0] != q35.hf_greedy(prompt, 12), "the adapter changes the continuation"
    for seq in results["sampled"].sequences:
        logp = q35.logprobs(prompt + seq.tokens, SLOT)
        expected = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(seq.tokens)]
        np.testing.assert_allclose(seq.logprobs, expected, atol=2e-4)


def test_prompt_cache_keeps_the_recurrent_state_and_prompt_logprobs_match(q35):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    sampler, results = q35.sampler, {}
    sampler.submit("first", req(prompt, 8, temperature=0.0), 0)
    drain(sampler, results)
    prefills, hits = sampler.prefill_count, sampler._prompt_cache.hits
    sampler.submit("again", req(prompt, 8, temperature=0.0), 0)
    drain(sampler, results)
    assert sampler.prefill_count == prefills and sampler._prompt_cache.hits == hits + 1
    entry = next(iter(sampler._prompt_cache._entries.values()))
    assert isinstance(entry, HybridCache) and float(jnp.abs(entry.linear.delta).sum()) > 0
    assert tokens(results["again"]) == tokens(results["first"]) == [q35.hf_greedy(prompt, 8)]

    scored = SampleRequest(prompt, 1, SamplingParams(max_tokens=1, temperature=0.0), "base", prompt_logprobs=True)
    sampler.submit("scored", scored, 0)
    drain(sampler, results)
    with torch.no_grad():
        ref = torch.log_softmax(q35.hf(torch.tensor([prompt])).logits[0], -1)
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    got = results["scored"].prompt_logprobs
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], want, atol=1e-4)
