"""The continuous-batching sampler against transformers and against our own teacher-forced forward pass.

Models are tiny random-weight checkpoints built with a wide initialiser, so their greedy outputs vary
from token to token (HF's default init gives near-uniform logits and repetitive text). One sampler per
model is shared by most tests so each shape compiles once; tests read counters as deltas.
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from adapter_view import FixedAdapters
from conftest import build_hf_model
from flax import nnx

from tx.engine.decode_steps import DecodePrograms, DecodeRows
from tx.engine.sampler import Sampler, SamplerConfig
from tx.engine.sampler_rows import plan_admission
from tx.engine.text import load_decoder
from tx.engine.train_step import flat
from tx.lora.layers import LoRASpec
from tx.lora.params import AdapterRoles, LoRAParam, LoRARows, slot_scale
from tx.models.causal_lm import LayerCache, decode_layout, split_layers
from tx.models.weights import load_model
from tx.protocol import RequestError, SampleRequest, SampleResult, SamplingParams
from tx.tuning import CPU

CFG = SamplerConfig(max_rows=8, max_seq_len=64, chunk_steps=4, length_buckets=(32, 64))
LORA_SLOT = 2
PROMPTS = [[1, 2, 3], [7], list(range(10, 22)), [5, 9, 40, 41, 200, 3, 8]]


def char_decode(ids: list[int]) -> str:
    """A stand-in tokenizer: one distinct character per token id."""
    return "".join(chr(0x100 + t) for t in ids)


def first_new_index(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


class Setup:
    def __init__(self, path: Path, family: str, tied: bool, lora: bool) -> None:
        self.hf = build_hf_model(path, family, 2, tied, initializer_range=0.3)
        self.hf.generation_config.eos_token_id = None  # compare whole continuations
        spec = LoRASpec(slots=3, max_rank=4) if lora else None
        self.model, self.cfg = load_model(str(path), lora=spec, progress=False)
        self.scale = None
        if lora:
            self._randomise_adapter()
            one = slot_scale(4, 8.0, 4)
            self.scale = jnp.stack([jnp.zeros_like(one), one, one])
        self.roles = AdapterRoles.of(nnx.state(self.model, LoRAParam))
        self.graphdef, self.state = nnx.split(self.model)
        # The engine's form: decoder weights split into per-layer buffers (the stacked `state` is the
        # reference the teacher-forced checks run on).
        self.weights = split_layers(flat(self.state), self.roles)
        # EOS is a token that greedy decoding of PROMPTS[0] reaches (tests not about EOS switch it off).
        greedy = self.hf_greedy(PROMPTS[0], 16)
        self.eos_index = first_new_index(greedy, 2)
        self.sampler = self.new_sampler(eos=(greedy[self.eos_index],))

    def _randomise_adapter(self) -> None:
        lora = nnx.state(self.model, LoRAParam)
        keys = iter(jax.random.split(jax.random.key(0), 64))

        def fill(x: jax.Array) -> jax.Array:
            # The slot axis sits third from the end of every A [..., S, I, R] and B [..., S, R, O].
            value = 0.3 * jax.random.normal(next(keys), x.shape[: x.ndim - 3] + x.shape[x.ndim - 2 :])
            return x.at[..., LORA_SLOT, :, :].set(value)

        nnx.update(self.model, jax.tree.map(fill, lora))

    def fixed(self, version: Callable[[], Hashable] | None = None) -> FixedAdapters:
        """This model's adapters as a bank would show them to the sampler: the scale table, by type."""
        return FixedAdapters(lambda: self.scale, version, roles=self.roles)

    def new_sampler(self, eos: tuple[int, ...] = ()) -> Sampler:
        scale = self.scale
        return Sampler(
            self.graphdef,
            lambda: self.weights,
            self.cfg,
            CFG,
            eos,
            char_decode,
            None if scale is None else FixedAdapters(lambda: scale, roles=self.roles),
        )

    def logprobs(self, tokens: list[int], slot: int = 0) -> np.ndarray:
        """Teacher-forced log_softmax [T, V] of the full forward pass (padded to one jitted shape)."""
        padded = np.zeros((1, CFG.max_seq_len), np.int32)
        padded[0, : len(tokens)] = tokens
        return np.asarray(self._forward(self.state, padded, jnp.array([slot], jnp.int32)))[0, : len(tokens)]

    @functools.partial(jax.jit, static_argnums=0)
    def _forward(self, state: nnx.State, tokens: jax.Array, slot: jax.Array) -> jax.Array:
        rows = None if self.scale is None else LoRARows(slot, self.scale)
        logits, _ = nnx.merge(self.graphdef, state)(tokens, rows=rows)
        return jax.nn.log_softmax(logits, axis=-1)

    def greedy(self, prompt: list[int], n: int, slot: int = 0) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(np.argmax(self.logprobs(tokens, slot)[-1])))
        return tokens[len(prompt) :]

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("qwen-sampler"), "qwen3", True, lora=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("llama-sampler"), "llama", False, lora=False)


def make_req(prompt: list[int], max_tokens: int = 12, n: int = 1, **params) -> SampleRequest:
    params.setdefault("stop_at_eos", False)
    return SampleRequest(list(prompt), n, SamplingParams(max_tokens=max_tokens, **params), "base")


def run(sampler: Sampler, requests: dict[str, tuple[SampleRequest, int]]) -> tuple[dict, list[str]]:
    """Submit all, step until idle; returns results by id and the order they finished in."""
    for request_id, (req, slot) in requests.items():
        sampler.submit(request_id, req, slot)
    results, order = {}, []
    while not sampler.idle():
        for request_id, result in sampler.step():
            results[request_id] = result
            order.append(request_id)
    return results, order


def tokens_of(result: SampleResult | RequestError) -> list[list[int]]:
    assert isinstance(result, SampleResult), result
    return [seq.tokens for seq in result.sequences]


@pytest.mark.parity
@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_greedy_batch_matches_transformers(name, request):
    setup = request.getfixturevalue(name)
    reqs = {f"r{i}": (make_req(p, temperature=0.0), 0) for i, p in enumerate(PROMPTS)}
    results, _ = run(setup.sampler, reqs)
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(results[f"r{i}"]) == [setup.hf_greedy(prompt, 12)]
        assert results[f"r{i}"].sequences[0].stop_reason == "length"


def test_adapter_rows_beside_base_rows(qwen):
    prompt = PROMPTS[2]
    reqs = {"base": (make_req(prompt, temperature=0.0), 0), "lora": (make_req(prompt, temperature=0.0), LORA_SLOT)}
    results, _ = run(qwen.sampler, reqs)
    adapted = tokens_of(results["lora"])[0]
    assert adapted == qwen.greedy(prompt, 12, LORA_SLOT)
    assert tokens_of(results["base"])[0] == qwen.hf_greedy(prompt, 12)
    assert adapted != tokens_of(results["base"])[0]


@pytest.mark.parametrize("slot", [0, LORA_SLOT])
def test_logprobs_match_teacher_forcing(qwen, slot):
    prompt = PROMPTS[3]
    reqs = {"t": (make_req(prompt, 16, n=2, temperature=1.0, seed=3), slot)}
    results, _ = run(qwen.sampler, reqs)
    for seq in results["t"].sequences:
        logp = qwen.logprobs(prompt + seq.tokens, slot)
        expected = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(seq.tokens)]
        np.testing.assert_allclose(seq.logprobs, expected, atol=2e-4)


def test_seeded_sample_is_the_same_alone_and_in_a_mixed_batch(qwen):
    target = make_req(PROMPTS[2], 14, temperature=0.9, top_p=0.95, seed=11)
    alone, _ = run(qwen.sampler, {"x": (target, LORA_SLOT)})
    mixed, _ = run(
        qwen.sampler,
        {
            "a": (make_req(PROMPTS[0], 20, temperature=1.0, top_k=5, seed=1), 0),
            "x": (target, LORA_SLOT),
            "b": (make_req(PROMPTS[3], 6, n=3, temperature=0.0), LORA_SLOT),
        },
    )
    assert tokens_of(mixed["x"]) == tokens_of(alone["x"])
    other, _ = run(qwen.sampler, {"y": (make_req(PROMPTS[2], 14, temperature=0.9, top_p=0.95, seed=12), LORA_SLOT)})
    assert tokens_of(other["y"]) != tokens_of(alone["x"])


def test_top_k_one_is_greedy(qwen):
    results, _ = run(qwen.sampler, {"k": (make_req(PROMPTS[0], 12, temperature=1.0, top_k=1, seed=5), 0)})
    assert tokens_of(results["k"]) == [qwen.hf_greedy(PROMPTS[0], 12)]


def test_stop_tokens_and_strings_end_the_sequence(llama):
    prompt = PROMPTS[3]
    greedy = llama.hf_greedy(prompt, 16)
    i = first_new_index(greedy, 3)
    # a two-token stop string whose first occurrence ends at token j + 2 (none earlier, prompt excluded)
    j = next(
        j for j in range(i, len(greedy) - 2) if char_decode(greedy[j + 1 : j + 3]) not in char_decode(greedy[: j + 2])
    )
    pair = char_decode(greedy[j + 1 : j + 3])
    reqs = {
        "tok": (make_req(prompt, 16, temperature=0.0, stop_token_ids=[greedy[i]]), 0),
        "str": (make_req(prompt, 16, temperature=0.0, stop_strings=[pair]), 0),
        "none": (make_req(prompt, 16, temperature=0.0, stop_token_ids=[]), 0),
    }
    results, _ = run(llama.sampler, reqs)
    assert tokens_of(results["tok"]) == [greedy[: i + 1]]
    assert results["tok"].sequences[0].stop_reason == "stop"
    assert tokens_of(results["str"]) == [greedy[: j + 3]]
    assert results["str"].sequences[0].stop_reason == "stop"
    assert tokens_of(results["none"]) == [greedy] and results["none"].sequences[0].stop_reason == "length"


def test_eos_stops_unless_disabled(llama):
    prompt = PROMPTS[0]
    greedy, i = llama.hf_greedy(prompt, 16), llama.eos_index
    reqs = {
        "eos": (make_req(prompt, 16, temperature=0.0, stop_at_eos=True), 0),
        "off": (make_req(prompt, 16, temperature=0.0, stop_at_eos=False), 0),
    }
    results, _ = run(llama.sampler, reqs)
    assert tokens_of(results["eos"]) == [greedy[: i + 1]] and results["eos"].sequences[0].stop_reason == "stop"
    assert tokens_of(results["off"]) == [greedy]


def test_short_request_overtakes_a_long_one_and_rows_shrink(qwen):
    sampler = qwen.sampler
    long_req = make_req(PROMPTS[2], 40, temperature=1.0, seed=21)
    short_req = make_req(PROMPTS[3], 4, n=2, temperature=0.7, seed=22)
    alone_long, _ = run(sampler, {"long": (long_req, 0)})
    alone_short, _ = run(sampler, {"short": (short_req, LORA_SLOT)})
    sampler.submit("long", long_req, 0)
    finished, shapes = {}, []
    for i in range(200):
        if i == 2:
            sampler.submit("short", short_req, LORA_SLOT)
        finished.update(sampler.step())
        shapes.append(sampler.cache_shape)
        if sampler.idle():
            break
    assert list(finished) == ["short", "long"]
    assert tokens_of(finished["short"]) == tokens_of(alone_short["short"])
    assert tokens_of(finished["long"]) == tokens_of(alone_long["long"])
    rows = [shape[0] for shape in shapes if shape]
    assert max(rows) > 1 and rows[-1] == 1, rows  # grew for the short request, shrank back to batch 1 after it


def test_num_samples_share_one_prefill(qwen):
    sampler = qwen.sampler
    before = sampler.prefill_count
    results, _ = run(sampler, {"n": (make_req(PROMPTS[2], 10, n=4, temperature=1.0, seed=4), LORA_SLOT)})
    assert sampler.prefill_count - before == 1
    samples = tokens_of(results["n"])
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    again, _ = run(sampler, {"n": (make_req(PROMPTS[2], 10, n=4, temperature=1.0, seed=4), LORA_SLOT)})
    assert tokens_of(again["n"]) == samples


def test_requests_with_one_prompt_share_its_prefill(qwen):
    """A GRPO group sent as separate calls: one prefill per distinct (prompt, weights), same tokens as alone."""
    sampler = qwen.sampler
    alone = {
        seed: tokens_of(run(sampler, {"a": (make_req(PROMPTS[3], 8, temperature=1.0, seed=seed), LORA_SLOT)})[0]["a"])
        for seed in (1, 2)
    }
    before = sampler.prefill_count
    group = {f"s{seed}": (make_req(PROMPTS[3], 8, temperature=1.0, seed=seed), LORA_SLOT) for seed in (1, 2)}
    group["base"] = (make_req(PROMPTS[3], 8, temperature=1.0, seed=1), 0)  # other weights: its own prefill
    results, _ = run(sampler, group)
    assert sampler.prefill_count - before == 2
    assert tokens_of(results["s1"]) == alone[1] and tokens_of(results["s2"]) == alone[2]
    assert tokens_of(results["base"]) != alone[1]


def test_prompt_cache_reuses_a_prefill_until_the_weights_change(qwen):
    scale = [qwen.scale]

    def sampler_over(version: bool) -> Sampler:
        return Sampler(
            qwen.graphdef, lambda: qwen.weights, qwen.cfg, CFG, (), char_decode,
            FixedAdapters(lambda: scale[0], (lambda: np.asarray(scale[0]).tobytes()) if version else None,
                          roles=qwen.roles),
            qwen.sampler.programs,
        )  # fmt: skip

    cached, reference = sampler_over(True), sampler_over(False)

    def req(seed: int) -> SampleRequest:
        return make_req(PROMPTS[2], 8, temperature=1.0, seed=seed)

    first, _ = run(cached, {"a": (req(3), LORA_SLOT)})
    again, _ = run(cached, {"b": (req(3), LORA_SLOT), "c": (req(5), LORA_SLOT)})
    assert cached.prefill_count == 1  # the second round copied the prompt's cache
    assert tokens_of(again["b"]) == tokens_of(first["a"])
    assert tokens_of(again["c"]) == tokens_of(run(reference, {"c": (req(5), LORA_SLOT)})[0]["c"])
    scale[0] = qwen.scale * 3  # new adapter scaling: a new weights version
    changed, _ = run(cached, {"d": (req(3), LORA_SLOT)})
    assert cached.prefill_count == 2
    assert tokens_of(changed["d"]) == tokens_of(run(reference, {"d": (req(3), LORA_SLOT)})[0]["d"])
    assert tokens_of(changed["d"]) != tokens_of(first["a"])


def test_the_base_weights_prompt_cache_is_kept_per_sampling_session(qwen):
    """The base weights serve every tenant: a prompt another session prefilled is computed again (a hit would
    let a tenant time a guessed prompt to learn another had sent it); the same session hits, and so does an
    adapter slot, whose weights are one owner's."""
    sampler = Sampler(
        qwen.graphdef, lambda: qwen.weights, qwen.cfg, CFG, (), char_decode,
        FixedAdapters(lambda: qwen.scale, lambda: "v1", roles=qwen.roles), qwen.sampler.programs,
    )  # fmt: skip

    def submit_and_run(request_id: str, slot: int, group: str) -> None:
        sampler.submit(request_id, make_req(PROMPTS[2], 2, temperature=0.0), slot, group)
        while not sampler.idle():
            sampler.step()

    submit_and_run("a", 0, "session-1")
    submit_and_run("b", 0, "session-2")
    assert sampler.prefill_count == 2
    submit_and_run("c", 0, "session-1")
    submit_and_run("d", LORA_SLOT, "session-1")
    submit_and_run("e", LORA_SLOT, "session-2")
    assert sampler.prefill_count == 3


def test_prompt_cache_within_its_byte_budget_keeps_the_most_recent_prompt(qwen):
    """A budget of one prompt's cache: a second prompt evicts the first, whose next use prefills again."""
    L, K, E = qwen.cfg.num_layers, qwen.cfg.num_kv_heads, qwen.cfg.head_dim
    one_prompt = 2 * L * CFG.length_buckets[0] * K * E * 4  # keys and values of a prompt in the 32 bucket, fp32
    cfg = dataclasses.replace(CFG, prompt_cache_bytes=one_prompt)
    sampler = Sampler(qwen.graphdef, lambda: qwen.weights, qwen.cfg, cfg, (), char_decode,
                      qwen.fixed(lambda: "v1"), qwen.sampler.programs)  # fmt: skip

    def prefills(prompt: list[int]) -> int:
        before = sampler.prefill_count
        results, _ = run(sampler, {"r": (make_req(prompt, 4, temperature=0.0), 0)})
        assert tokens_of(results["r"]) == [qwen.hf_greedy(prompt, 4)]
        return sampler.prefill_count - before

    assert [prefills(PROMPTS[2]), prefills(PROMPTS[2]), prefills(PROMPTS[3]), prefills(PROMPTS[2])] == [1, 0, 1, 1]
    assert prefills(PROMPTS[2]) == 0 and prefills(PROMPTS[3]) == 1


def test_prompts_prefilled_together_are_kept_apart(qwen):
    """Each prompt of one admission is kept as its own prefill row: sampled again from the cache, each gives the
    greedy continuation of its own prompt."""
    sampler = Sampler(qwen.graphdef, lambda: qwen.weights, qwen.cfg, CFG, (), char_decode,
                      qwen.fixed(lambda: "v1"), qwen.sampler.programs)  # fmt: skip
    prompts = {"b": PROMPTS[2], "c": PROMPTS[3]}
    for _ in range(2):
        results, _ = run(sampler, {k: (make_req(p, 4, temperature=0.0), 0) for k, p in prompts.items()})
        assert {k: tokens_of(r) for k, r in results.items()} == {k: [qwen.hf_greedy(p, 4)] for k, p in prompts.items()}
    assert sampler.prefill_count == 2 and sampler._prompt_cache.hits == 2


def test_more_samples_than_rows(qwen):
    sampler = qwen.sampler
    before = sampler.prefill_count
    results, _ = run(sampler, {"n": (make_req(PROMPTS[0], 5, n=11, temperature=1.0, seed=9), 0)})
    assert len(tokens_of(results["n"])) == 11
    assert sampler.prefill_count - before == 2  # 8 rows, then the remaining 3


def test_prompt_logprobs_match_teacher_forcing(qwen):
    prompt = PROMPTS[3]
    req = make_req(prompt, 3, temperature=0.0)
    req.prompt_logprobs, req.topk_prompt_logprobs = True, 3
    one = make_req([7], 2, temperature=0.0)
    one.prompt_logprobs = True
    results, _ = run(qwen.sampler, {"p": (req, LORA_SLOT), "one": (one, 0), "plain": (make_req(prompt, 2), 0)})
    logp = qwen.logprobs(prompt, LORA_SLOT)
    got = results["p"]
    assert np.isnan(got.prompt_logprobs[0]) and got.topk_prompt_logprobs.ids.shape == (len(prompt), 3)
    expected = [logp[j - 1, prompt[j]] for j in range(1, len(prompt))]
    np.testing.assert_allclose(got.prompt_logprobs[1:], expected, atol=2e-4)
    for j in range(1, len(prompt)):
        assert got.topk_prompt_logprobs.ids[j].tolist() == list(np.argsort(-logp[j - 1])[:3])
        np.testing.assert_allclose(got.topk_prompt_logprobs.logprobs[j], np.sort(logp[j - 1])[::-1][:3], atol=2e-4)
    assert results["one"].prompt_logprobs.shape == (1,) and np.isnan(results["one"].prompt_logprobs[0])
    assert results["plain"].prompt_logprobs is None and results["plain"].topk_prompt_logprobs is None


def test_every_prompt_top_k_up_to_twenty_is_one_prefill_program(qwen):
    """A tenant stepping through top-k 1, 2, 3, 5, ... would otherwise compile a full-model prefill for each
    width while every other tenant's sampling waits; the widths share one, and each result keeps its own k."""
    prompt = PROMPTS[3]

    def scored(k: int) -> SampleRequest:
        req = make_req(prompt, 1, temperature=0.0)
        req.prompt_logprobs, req.topk_prompt_logprobs = True, k
        return req

    run(qwen.sampler, {"warm": (scored(1), 0)})
    compiled = qwen.sampler.compile_count
    for k in (2, 3, 5, 7, 12, 20):
        results, _ = run(qwen.sampler, {"k": (scored(k), 0)})
        assert results["k"].topk_prompt_logprobs.ids.shape == (len(prompt), k)
    assert qwen.sampler.compile_count == compiled


def test_prompt_scores_in_blocks_only_for_the_rows_that_asked(qwen):
    """Scores computed 16 positions at a time over a 24-position prompt bucket (padded to two blocks)
    equal teacher forcing; the prompts that did not ask are prefilled apart, without scores."""
    cfg = dataclasses.replace(CFG, length_buckets=(24, 64))
    V = qwen.cfg.vocab_size
    programs = DecodePrograms(qwen.graphdef, cfg.chunk_steps, cfg.k_cap, qwen.roles, score_elements=2 * 16 * V)
    calls: list[tuple[int, bool]] = []
    prefill = programs.prefill

    def recorded(state, adapters, batch, *, scores, topk):
        calls.append((batch.tokens.shape[0], scores))
        return prefill(state, adapters, batch, scores=scores, topk=topk)

    programs.prefill = recorded
    sampler = Sampler(qwen.graphdef, lambda: qwen.weights, qwen.cfg, cfg, (), char_decode, qwen.fixed(), programs)
    long_prompt = [(7 * i + 3) % V for i in range(20)]
    asks = {"a": (long_prompt, LORA_SLOT), "b": (PROMPTS[3], 0)}
    requests = {name: (make_req(prompt, 2), slot) for name, (prompt, slot) in asks.items()}
    for req, _ in requests.values():
        req.prompt_logprobs, req.topk_prompt_logprobs = True, 2
    plain = [PROMPTS[0], PROMPTS[2], [5, 6, 7, 8]]
    requests.update({f"plain{i}": (make_req(prompt, 2), 0) for i, prompt in enumerate(plain)})
    results, _ = run(sampler, requests)
    assert sorted(calls) == [(2, True), (4, False)]
    for name, (prompt, slot) in asks.items():
        logp = qwen.logprobs(prompt, slot)
        got = results[name]
        np.testing.assert_allclose(
            got.prompt_logprobs[1:], [logp[j - 1, prompt[j]] for j in range(1, len(prompt))], atol=2e-4
        )
        for j in range(1, len(prompt)):
            assert got.topk_prompt_logprobs.ids[j].tolist() == list(np.argsort(-logp[j - 1])[:2])
    assert all(results[f"plain{i}"].prompt_logprobs is None for i in range(3))


def test_invalid_requests_are_user_errors(qwen):
    results, _ = run(
        qwen.sampler,
        {"long": (make_req([1] * 60, 6), 0), "empty": (make_req([], 5), 0), "slot": (make_req([1, 2], 3), 3)},
    )
    assert isinstance(results["long"], RequestError) and results["long"].category == "user"
    assert "max_seq_len" in results["long"].message and "64" in results["long"].message
    assert isinstance(results["empty"], RequestError) and results["empty"].category == "user"
    # A slot past the table is the engine's own mistake, not the caller's.
    assert isinstance(results["slot"], RequestError) and results["slot"].category == "server"
    assert "adapter slot 3 does not exist" in results["slot"].message
    fits, _ = run(qwen.sampler, {"edge": (make_req([1, 2, 3], 62, temperature=0.0), 2)})  # 3 + 62 - 1 = max_seq_len
    assert len(tokens_of(fits["edge"])[0]) == 62
    over, _ = run(qwen.sampler, {"over": (make_req([1, 2, 3], 63), 2)})
    assert isinstance(over["over"], RequestError) and "max_seq_len" in over["over"].message


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused(qwen, tmp_path):
    sampler = qwen.new_sampler()
    sampler.decode, _ = load_decoder(tmp_path)  # no tokenizer files: they could never match
    results, _ = run(
        sampler,
        {"text": (make_req([1, 2], 4, stop_strings=["ab"]), 0), "ids": (make_req([1, 2], 4, stop_token_ids=[7]), 0)},
    )
    assert isinstance(results["text"], RequestError) and results["text"].category == "user"
    assert "sampling_params.stop" in results["text"].message and "tokenizer" in results["text"].message
    assert not isinstance(results["ids"], RequestError)


def test_a_full_context_sequence_is_scored_as_the_training_forward_scores_it(qwen):
    """compute_logprobs (one token drawn, the prompt scored) of a sequence as long as the context: the cookbook
    scores prompt + completion for its KL penalty, and a rollout that reached the context length was refused
    (prompt + max_tokens 1 > max_seq_len), though the token drawn last takes no position. The scores equal
    teacher forcing."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, qwen.cfg.vocab_size, 64)]
    req = make_req(prompt, 1, temperature=0.0)
    req.prompt_logprobs = True
    got, _ = run(qwen.sampler, {"full": (req, LORA_SLOT)})
    result = got["full"]
    assert not isinstance(result, RequestError), result
    logp = qwen.logprobs(prompt, LORA_SLOT)
    expected = [logp[j - 1, prompt[j]] for j in range(1, len(prompt))]
    np.testing.assert_allclose(result.prompt_logprobs[1:], expected, atol=2e-4)


def test_sampler_config_refuses_what_cannot_work():
    for bad in (dict(max_rows=0), dict(chunk_steps=0), dict(k_cap=0), dict(max_prefill_tokens=0),
                dict(max_seq_len=0), dict(prompt_cache_bytes=-1), dict(max_rows=8, row_buckets=(1, 4)),
                dict(max_seq_len=64, length_buckets=(32,)), dict(max_rows=8, row_buckets=(4, 2, 8)),
                dict(max_seq_len=64, length_buckets=(64, 32, 64))):  # fmt: skip
        with pytest.raises(ValueError):
            SamplerConfig(**bad)
    assert SamplerConfig(
        prompt_cache_bytes=0, max_rows=1, chunk_steps=1, k_cap=1, max_prefill_tokens=1
    ).row_buckets == (1,)
    assert SamplerConfig(max_rows=6, max_seq_len=300).row_buckets == (1, 2, 4, 6)
    assert SamplerConfig(max_rows=6, max_seq_len=300).length_buckets == (128, 256, 300)


def test_a_one_token_prompt_needs_no_prefill(qwen):
    before = qwen.sampler.prefill_count
    results, _ = run(qwen.sampler, {"one": (make_req([7], 6, temperature=0.0), 0)})
    assert tokens_of(results["one"]) == [qwen.hf_greedy([7], 6)] and qwen.sampler.prefill_count == before


def test_a_failed_device_call_fails_what_the_cache_held_and_sampling_goes_on(qwen, monkeypatch):
    """The decode chunk raises once: the request in the cache fails (its samples still waiting too), the
    request that was only waiting then runs as if nothing happened."""
    programs = qwen.sampler.programs
    decode, calls = programs.decode, []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("planted device fault")
        return decode(*args, **kwargs)

    monkeypatch.setattr(programs, "decode", faulty)
    before = qwen.sampler.prefill_count
    held = make_req(PROMPTS[0], 5, n=11, temperature=1.0, seed=9)  # 8 rows now, 3 samples still waiting
    results, _ = run(qwen.sampler, {"held": (held, 0), "next": (make_req(PROMPTS[2], 8, temperature=0.0), 0)})
    assert isinstance(results["held"], RequestError) and results["held"].category == "server"
    assert results["held"].message == "sampling failed: RuntimeError: planted device fault"
    assert tokens_of(results["next"]) == [qwen.hf_greedy(PROMPTS[2], 8)]
    assert qwen.sampler.prefill_count - before == 2  # the failed request's other samples never started
    assert qwen.sampler.idle() and qwen.sampler.cache_shape is None


def test_a_failed_cache_allocation_fails_the_requests_it_admitted(qwen, monkeypatch):
    """Allocating the decode cache raises once (out of memory, say) in the step that admits two requests:
    both fail with the cause (none is left without an outcome), and the next request samples as usual."""
    programs = qwen.sampler.programs
    empty, calls = programs.empty, []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("planted allocation fault")
        return empty(*args, **kwargs)

    monkeypatch.setattr(programs, "empty", faulty)
    assert qwen.sampler.idle() and qwen.sampler.cache_shape is None
    reqs = {"a": (make_req(PROMPTS[0], 4, n=2), 0), "b": (make_req(PROMPTS[2], 4), 0)}
    results, _ = run(qwen.sampler, reqs)
    for name in reqs:
        assert results[name] == RequestError("sampling failed: MemoryError: planted allocation fault", "server")
    results, _ = run(qwen.sampler, {"next": (make_req(PROMPTS[2], 8, temperature=0.0), 0)})
    assert tokens_of(results["next"]) == [qwen.hf_greedy(PROMPTS[2], 8)]


def test_a_request_whose_rows_fail_fails_once(qwen, monkeypatch):
    """Both sample rows of one request fail their bookkeeping in the same chunk: the request fails once
    (its second row is not reported again), the request beside it finishes as usual."""
    from tx.engine import sampler_rows

    advance = sampler_rows.Row.advance

    def faulty(self, tokens, logprobs):
        if self.job.request_id == "bad":
            raise RuntimeError("planted row fault")
        return advance(self, tokens, logprobs)

    monkeypatch.setattr(sampler_rows.Row, "advance", faulty)
    reqs = {"bad": (make_req(PROMPTS[0], 4, n=2), 0), "good": (make_req(PROMPTS[2], 4, temperature=0.0), 0)}
    for request_id, (req, slot) in reqs.items():
        qwen.sampler.submit(request_id, req, slot)
    outcomes = []
    while not qwen.sampler.idle():
        outcomes += qwen.sampler.step()
    assert sorted(request_id for request_id, _ in outcomes) == ["bad", "good"]
    assert dict(outcomes)["bad"] == RequestError("sampling failed: RuntimeError: planted row fault", "server")


def test_replayed_workload_compiles_nothing_new(qwen):
    def workload() -> dict:
        reqs = {
            "a": (make_req(PROMPTS[0], 9, n=3, temperature=1.0, seed=1), LORA_SLOT),
            "b": (make_req(PROMPTS[2], 30, temperature=0.5, top_k=3, seed=2), 0),
        }
        return run(qwen.sampler, reqs)[0]

    first = workload()
    compiled = qwen.sampler.compile_count
    assert tokens_of(workload()["b"]) == tokens_of(first["b"])
    assert qwen.sampler.compile_count == compiled


def test_stacked_weights_sample_like_split_ones(qwen):
    """The scanned program over stacked weights and the unrolled one over per-layer buffers (another
    attention form, another cache layout) give the same tokens and logprobs for a mixed batch."""
    stacked = Sampler(
        qwen.graphdef, lambda: qwen.state, qwen.cfg, CFG, (), char_decode, qwen.fixed()
    )  # fmt: skip

    def workload() -> dict:
        scored = make_req(PROMPTS[3], 10, n=2, temperature=1.0, seed=4)
        scored.prompt_logprobs = True
        return {"s": (scored, LORA_SLOT), "g": (make_req(PROMPTS[2], 12, temperature=0.0), 0)}

    split_results, _ = run(qwen.sampler, workload())
    stacked_results, _ = run(stacked, workload())
    for key in ("s", "g"):
        assert tokens_of(split_results[key]) == tokens_of(stacked_results[key])
        for a, b in zip(split_results[key].sequences, stacked_results[key].sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    np.testing.assert_allclose(
        split_results["s"].prompt_logprobs[1:], stacked_results["s"].prompt_logprobs[1:], atol=1e-4
    )


def test_split_layers_gives_each_layer_its_slice(qwen):
    weights = flat(qwen.state)
    split = split_layers(weights, qwen.roles)
    layers = qwen.cfg.num_layers
    for path, value in weights.items():
        if path[:2] == ("model", "layers") and path not in qwen.roles:
            assert path not in split
            for i in range(layers):
                np.testing.assert_array_equal(np.asarray(split[(*path[:2], str(i), *path[2:])]), np.asarray(value[i]))
        else:  # adapters and the rest stay as they are
            np.testing.assert_array_equal(np.asarray(split[path]), np.asarray(value))
    assert len(split) == len(weights) + (layers - 1) * sum(
        1 for p in weights if p[:2] == ("model", "layers") and p not in qwen.roles
    )


def test_decode_layout_copy_shares_no_buffer(qwen):
    """A full fine-tuning run's sampler snapshot must survive the run's next AdamW step, which donates
    (frees) the run's weights: no entry of the copy may be one of the originals."""
    weights = {p: jnp.array(v, copy=True) for p, v in flat(qwen.state).items()}
    snapshot = decode_layout(weights, CPU, copy=True)
    originals = {v.unsafe_buffer_pointer() for v in weights.values()}
    assert not originals & {v.unsafe_buffer_pointer() for v in snapshot.values()}
    for v in weights.values():
        v.delete()
    assert all(np.isfinite(np.asarray(v)).all() for v in snapshot.values())


def test_decode_updates_the_cache_in_place(qwen):
    """The compiled decode chunk never copies a layer's cache buffer (a read-then-write order made XLA
    copy every layer's cache twice per step, which cost more than the attention itself at batch 32)."""
    B, S = 8, 64
    cache = LayerCache.zeros(qwen.cfg, B, S)
    rows = DecodeRows(
        *(jnp.zeros(B, jnp.int32) for _ in range(3)), jnp.zeros(B, jnp.uint32),
        jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.float32),
    )  # fmt: skip
    text = qwen.sampler.programs.decode.lower(qwen.weights, None, cache, rows).compile().as_text()
    K, E = qwen.cfg.num_kv_heads, qwen.cfg.head_dim
    for shape in (f"[{B},{K},{E},{S}]", f"[{B},{K},{S},{E}]"):
        assert shape in text  # the per-layer buffers are there
        copies = [line for line in text.splitlines() if shape in line and " copy(" in line]
        assert not copies, copies[:2]


def test_plan_admission_is_fifo_and_bounded():
    assert plan_admission([(2, 10), (3, 10), (1, 10)], free_rows=4, max_rows=8, prefill_budget=100) == [2]
    assert plan_admission([(2, 10), (1, 10)], free_rows=4, max_rows=8, prefill_budget=100) == [2, 1]
    assert plan_admission([(20, 10), (1, 10)], free_rows=5, max_rows=8, prefill_budget=100) == [5]
    assert plan_admission([(1, 90), (1, 90)], free_rows=4, max_rows=8, prefill_budget=100) == [1]
    assert plan_admission([(1, 900)], free_rows=4, max_rows=8, prefill_budget=100) == [1]
    # the budget counts padded tokens: every admitted prompt is padded to the longest
    assert plan_admission([(1, 40)] + [(1, 5)] * 6, free_rows=8, max_rows=8, prefill_budget=100) == [1, 1]
    assert plan_admission([(1, 5)] * 3 + [(1, 40)], free_rows=8, max_rows=8, prefill_budget=100) == [1, 1, 1]


def test_a_split_burst_takes_the_next_compiled_bucket(qwen):
    """Two requests admitted after a round of four decode in the four-row shapes already compiled (as
    the first part of a client's burst would) instead of compiling two-row ones, with the same tokens as
    a sampler that decodes them at two rows; a lone request that only shrinks the batch still moves down."""
    fresh = Sampler(qwen.graphdef, lambda: qwen.state, qwen.cfg, CFG, (), char_decode, qwen.fixed())
    four = {f"r{i}": (make_req(PROMPTS[i % 4], 6, temperature=1.0, seed=30 + i), 0) for i in range(4)}
    run(fresh, four)
    compiled = fresh.compile_count
    two = {"a": (make_req(PROMPTS[0], 6, temperature=1.0, seed=40), 0), "b": (make_req(PROMPTS[1], 6, seed=41), 0)}
    fresh.submit("a", two["a"][0], 0)
    fresh.submit("b", two["b"][0], 0)
    fresh.step()
    assert fresh.cache_shape is not None and fresh.cache_shape[0] == 4
    results = dict(fresh.step())
    while not fresh.idle():
        results.update(fresh.step())
    assert fresh.compile_count == compiled
    alone = Sampler(qwen.graphdef, lambda: qwen.state, qwen.cfg, CFG, (), char_decode, qwen.fixed())
    expected, _ = run(alone, two)
    assert {k: tokens_of(v) for k, v in results.items()} == {k: tokens_of(v) for k, v in expected.items()}


def test_one_clients_backlog_delays_anothers_request_by_one_of_its_requests(qwen):
    """Waiting requests take turns by sampling session: before, admission was first come, first served, so a
    session's backlog of requests that each fill every row held another session's one-token request behind
    all of them. A session's own requests keep their order."""
    sampler = qwen.sampler
    for i in range(5):
        sampler.submit(f"a{i}", make_req(PROMPTS[0], 8, n=CFG.max_rows, temperature=1.0, seed=i), 0, "session-a")
    sampler.submit("b", make_req(PROMPTS[1], 1, temperature=0.0), 0, "session-b")
    order = []
    while not sampler.idle():
        order += [request_id for request_id, _ in sampler.step()]
    assert order.index("b") < order.index("a1") and [r for r in order if r != "b"] == [f"a{i}" for i in range(5)]


def test_the_queue_takes_turns_by_group():
    from collections import deque

    from tx.engine.sampler_rows import Job, queue_fairly

    waiting: deque[Job] = deque()
    for name in ["a1", "a2", "a3", "b1", "c1", "b2", "a4"]:
        queue_fairly(waiting, Job(name, None, 0, [], None, group=name[0]))  # type: ignore[arg-type]
    assert [job.request_id for job in waiting] == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    waiting.popleft()  # a1 admitted: a's next request keeps its turn, a new group's first goes ahead of it
    queue_fairly(waiting, Job("d1", None, 0, [], None, group="d"))  # type: ignore[arg-type]
    assert [job.request_id for job in waiting] == ["b1", "c1", "d1", "a2", "b2", "a3", "a4"]
