"""The backend tuning table is honoured: with the tuning an accelerator gets (`for_backend("gpu")`, the plain
form of every piece) forced on CPU, the model, the sampler and the weight layout take the plain forms, hold
no second copy of the weights, and compute what the CPU-tuned forms compute."""

import dataclasses

import jax
import numpy as np
import pytest
from adapter_view import FixedAdapters
from conftest import build_hf_model
from flax import nnx

from tx.engine.bank import AdapterBank
from tx.engine.decode_steps import DecodeRows
from tx.engine.sampler import Sampler, SamplerConfig
from tx.engine.train_step import flat
from tx.engine.trainer import Trainer
from tx.lora.layers import LoRASpec
from tx.lora.params import AdapterRoles, LoRAParam, slot_scale
from tx.models.causal_lm import KVCache, LayerCache, decode_layout
from tx.models.weights import load_model
from tx.protocol import Datum, ForwardBackwardRequest, LoraConfig, SampleRequest, SamplingParams
from tx.tuning import CPU, PLAIN, for_backend

GPU = for_backend("gpu")
SLOT = 2
CFG = SamplerConfig(max_rows=8, max_seq_len=64, chunk_steps=4, length_buckets=(32, 64))


def test_table_gives_accelerators_the_plain_forms():
    assert for_backend("cpu") is CPU and for_backend() is CPU  # the tests run on CPU
    for name in ("gpu", "tpu", "rocm"):
        assert for_backend(name) == dataclasses.replace(PLAIN, backend=name)
    assert (GPU.weight_major_rows, GPU.per_layer_decode, GPU.lora_kernel) == (0, False, "indexed")
    assert GPU.auto_dtype == "bfloat16" and GPU.compiler_options() == {}
    assert CPU.per_layer_decode and CPU.weight_major_rows > 1 and CPU.lora_kernel == "gather"


class Tuned:
    """One tiny checkpoint loaded with a given tuning; adapter slot `SLOT` holds the same random adapter."""

    def __init__(self, path, tuning) -> None:
        self.tuning = tuning
        model, self.cfg = load_model(str(path), lora=LoRASpec(3, 4, tuning.lora_kernel), tuning=tuning, progress=False)
        lora = nnx.state(model, LoRAParam)
        keys = iter(jax.random.split(jax.random.key(0), 64))
        nnx.update(model, jax.tree.map(lambda x: x.at[..., SLOT, :, :].set(0.3 * _normal(next(keys), x)), lora))
        self.model = model
        self.roles = AdapterRoles.of(lora)
        self.graphdef, self.state = nnx.split(model)
        self.weights = decode_layout(flat(self.state), tuning, adapters=self.roles)
        one = np.asarray(slot_scale(4, 8.0, 4))
        self.scale = np.stack([np.zeros_like(one), one, one])
        sampler_cfg = dataclasses.replace(CFG, layer_cache=tuning.per_layer_decode)
        self.sampler = Sampler(
            self.graphdef, lambda: self.weights, self.cfg, sampler_cfg, (), lambda ids: "",
            FixedAdapters(lambda: self.scale, roles=self.roles),
        )  # fmt: skip


def _normal(key: jax.Array, x: jax.Array) -> jax.Array:
    return jax.random.normal(key, x.shape[: x.ndim - 3] + x.shape[x.ndim - 2 :])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-tuning")
    build_hf_model(path, "qwen3", 2, True, initializer_range=0.3)
    return Tuned(path, CPU), Tuned(path, GPU)


def test_plain_layout_reads_the_trainers_buffers(pair):
    """No doubled weight memory: the plain tuning's sampler reads the very arrays it is given."""
    cpu, gpu = pair
    weights = flat(gpu.state)
    plain = decode_layout(weights, GPU, adapters=gpu.roles)
    assert plain.keys() == weights.keys() and all(plain[p] is weights[p] for p in weights)
    split = decode_layout(weights, CPU, adapters=gpu.roles)
    layer_weights = [p for p in weights if p[:2] == ("model", "layers") and p not in gpu.roles]
    assert len(split) == len(weights) + (cpu.cfg.num_layers - 1) * len(layer_weights)
    snapshot = decode_layout(weights, GPU, copy=True)  # a snapshot still owns its buffers
    assert not {v.unsafe_buffer_pointer() for v in weights.values()} & {
        v.unsafe_buffer_pointer() for v in snapshot.values()
    }


def _decode_program(tuned: Tuned, B: int, S: int):  # noqa: ANN202
    form = LayerCache if tuned.tuning.per_layer_decode else KVCache
    rows = DecodeRows(
        *(jax.numpy.zeros(B, jax.numpy.int32) for _ in range(3)), jax.numpy.zeros(B, jax.numpy.uint32),
        jax.numpy.ones(B), jax.numpy.zeros(B, jax.numpy.int32), jax.numpy.ones(B),
    )  # fmt: skip
    return tuned.sampler.programs.decode.lower(tuned.weights, None, form.zeros(tuned.cfg, B, S), rows)


def _decode_text(tuned: Tuned, B: int, S: int) -> str:
    return _decode_program(tuned, B, S).as_text()


def test_plain_decode_has_no_cpu_tricks(pair):
    """The CPU program multiplies weight-major behind a barrier; the plain one has neither barrier nor a
    per-chunk cache re-layout (the stacked cache goes in and comes out as it is)."""
    cpu, gpu = pair
    assert "optimization_barrier" in _decode_text(cpu, 8, 32)
    text = _decode_text(gpu, 8, 32)
    L, K, E = gpu.cfg.num_layers, gpu.cfg.num_kv_heads, gpu.cfg.head_dim
    assert "optimization_barrier" not in text
    relayouts = [line for line in text.splitlines() if "transpose" in line and f"tensor<{L}x8x32x{K}x{E}xf32>" in line]
    assert not relayouts, relayouts[:2]


def test_plain_decode_updates_the_stacked_cache_in_place(pair):
    """The donated stacked cache is written where it lies: no copy of it in the compiled chunk."""
    gpu = pair[1]
    text = _decode_program(gpu, 8, 32).compile().as_text()
    shape = f"[{gpu.cfg.num_layers},8,32,{gpu.cfg.num_kv_heads},{gpu.cfg.head_dim}]"
    assert shape in text
    copies = [line for line in text.splitlines() if shape in line and " copy(" in line]
    assert not copies, copies[:2]


def _request(prompt: list[int], n: int, max_tokens: int, temperature: float, scored: bool = False) -> SampleRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=len(prompt), stop_at_eos=False)
    return SampleRequest(prompt, n, params, "base", prompt_logprobs=scored)


def _sample_all(sampler: Sampler) -> dict:
    """A mixed workload: adapter and base rows, a long and a short request (the rows shrink: a resize),
    prompt logprobs."""
    reqs = {
        "long": (_request([3, 9, 27, 81], 1, 30, 1.0), 0),
        "short": (_request([5, 6], 2, 5, 0.0), SLOT),
        "scored": (_request([7, 8, 9, 10, 11], 1, 6, 0.7, scored=True), SLOT),
    }
    for request_id, (req, slot) in reqs.items():
        sampler.submit(request_id, req, slot)
    results, forms = {}, set()
    while not sampler.idle():
        results.update(sampler.step())
        forms.add(type(sampler._cache))
    return {"results": results, "forms": forms}


def test_plain_tuning_samples_like_cpu(pair):
    cpu, gpu = pair
    want, got = _sample_all(cpu.sampler), _sample_all(gpu.sampler)
    assert want["forms"] <= {LayerCache, type(None)} and got["forms"] <= {KVCache, type(None)}
    for key, result in want["results"].items():
        other = got["results"][key]
        assert [s.tokens for s in result.sequences] == [s.tokens for s in other.sequences], key
        for a, b in zip(result.sequences, other.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    np.testing.assert_allclose(
        want["results"]["scored"].prompt_logprobs[1:], got["results"]["scored"].prompt_logprobs[1:], atol=1e-4
    )


def test_plain_tuning_trains_like_cpu(pair):
    """The LoRA gradient of the indexed kernel (the plain form) equals the one-hot gather's."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, pair[0].cfg.vocab_size, 25)
    req = ForwardBackwardRequest([Datum(tokens[:-1].tolist(), {"target_tokens": tokens[1:]})], "cross_entropy")
    grads = []
    for tuned in pair:
        trainer = Trainer(tuned.model, AdapterBank.of(tuned.model))
        run = trainer.create_lora_run("run", LoraConfig(rank=4), slot=1)
        init = np.random.RandomState(1)  # both trainers get the same adapter
        params = {p: init.normal(0, 0.1, v.shape).astype(np.float32) for p, v in trainer.run_params(run).items()}
        trainer.set_run_params(run, params)
        trainer.forward_backward([("run", req)])
        grads.append({p: np.asarray(g) for p, g in run.grads.items()})
    for path, want in grads[0].items():
        np.testing.assert_allclose(grads[1][path], want, rtol=1e-4, atol=1e-6, err_msg=str(path))
