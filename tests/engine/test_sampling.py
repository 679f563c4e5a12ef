"""Token selection (greedy, top-k/top-p frequencies, batch independence, raw logprobs) and stop handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.engine.sampling import (
    Finish,
    StopChecker,
    resolve_seed,
    row_keys,
    sample_seeds,
    select_tokens,
)

select = jax.jit(select_tokens, static_argnames=("k_cap",))
V = 300  # above the default k_cap, so the capped path and the per-row threshold path both run


def _row_params(B: int, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> dict[str, jax.Array]:
    return {
        "temperature": jnp.full((B,), temperature, jnp.float32),
        "top_k": jnp.full((B,), top_k, jnp.int32),
        "top_p": jnp.full((B,), top_p, jnp.float32),
    }


def _keys(seeds: list[int] | np.ndarray, steps: list[int] | np.ndarray) -> jax.Array:
    return row_keys(jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.int32))


def _gumbel(keys: jax.Array, V: int) -> jax.Array:
    """The noise of every token [B, V], as `select_tokens` makes it for any one of them."""
    from tx.engine.sampling import _noise_at, _row_hash

    return _noise_at(_row_hash(keys), jnp.arange(V, dtype=jnp.uint32)[None, :])


def _logits(B: int, V: int, seed: int = 0, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, V)) * scale, jnp.float32)


def test_row_keys_depend_only_on_seed_and_index() -> None:
    keys = _keys([7, 7, 8, 7], [3, 3, 3, 4])
    data = jax.random.key_data(keys)
    expected = jax.random.key_data(jax.random.fold_in(jax.random.key(7), 3))
    np.testing.assert_array_equal(data[0], expected)
    np.testing.assert_array_equal(data[0], data[1])
    assert not np.array_equal(data[0], data[2]) and not np.array_equal(data[0], data[3])


def test_greedy_and_top_k_one_are_argmax_with_raw_logprobs() -> None:
    logits = _logits(8, V, scale=3.0)
    keys = _keys(np.arange(8), np.zeros(8))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for params in (_row_params(8, temperature=0.0), _row_params(8, temperature=1.5, top_k=1)):
        tokens, logprobs = select(logits, keys, **params)
        np.testing.assert_array_equal(tokens, argmax)
        np.testing.assert_allclose(logprobs, log_softmax[np.arange(8), argmax], rtol=1e-6)

    # Sampled rows report log_softmax of the unscaled, untruncated logits at the chosen token.
    tokens, logprobs = select(logits, keys, **_row_params(8, temperature=0.5, top_k=5, top_p=0.9))
    assert tokens.dtype == jnp.int32 and logprobs.dtype == jnp.float32
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(8), np.asarray(tokens)], rtol=1e-6)


def test_token_is_independent_of_batch_composition_and_path() -> None:
    """Four target rows give the same tokens alone, reordered, and beside a row taking the threshold path."""
    logits = _logits(8, V, seed=1)
    seeds = np.array([11, 12, 13, 14, 21, 22, 23, 24])
    steps = np.array([0, 5, 9, 2, 1, 1, 1, 1])
    temperature = jnp.array([1.0, 0.7, 1.3, 1.0, 1.0, 0.0, 1.0, 1.0])
    top_k = jnp.array([-1, 20, -1, 40, -1, -1, 5, -1], jnp.int32)  # targets are rows 0..3
    top_p = jnp.array([1.0, 1.0, 0.9, 0.8, 1.0, 1.0, 1.0, 0.3])

    def run(rows: np.ndarray, top_k: jax.Array = top_k) -> np.ndarray:
        tokens, _ = select(logits[rows], _keys(seeds[rows], steps[rows]), temperature[rows], top_k[rows], top_p[rows])
        return np.asarray(tokens)

    base = run(np.arange(8))
    order = np.array([7, 3, 6, 0, 5, 2, 4, 1])
    np.testing.assert_array_equal(run(order)[np.argsort(order)], base)
    wide = top_k.at[4].set(250)  # above k_cap: row 4 finds its own thresholds
    np.testing.assert_array_equal(run(np.arange(8), wide)[:4], base[:4])
    for row in range(4):
        assert run(np.array([row]))[0] == base[row]


def test_per_row_thresholds_keep_what_the_ranked_vocabulary_keeps() -> None:
    """Rows past the top-4 candidates (wider top-k, wide nuclei, both) find their thresholds by bisection: the
    same tokens, row for row, as drawing from the whole vocabulary ranked by top-k (k_cap = V)."""
    B = 96
    rng = np.random.default_rng(5)
    logits = _logits(B, V, seed=4, scale=2.0)
    keys = _keys(np.arange(B), np.full(B, 3))
    temperature = jnp.asarray(rng.uniform(0.5, 1.5, B), jnp.float32)
    top_k = jnp.asarray(np.where(rng.random(B) < 0.6, rng.integers(1, V, B), -1), jnp.int32)
    top_p = jnp.asarray(np.where(rng.random(B) < 0.6, rng.uniform(0.05, 0.99, B), 1.0), jnp.float32)
    thresholds, _ = select(logits, keys, temperature, top_k, top_p, k_cap=4)
    ranked, _ = select(logits, keys, temperature, top_k, top_p, k_cap=V)
    np.testing.assert_array_equal(thresholds, ranked)
    assert len(np.unique(np.asarray(ranked))) > B // 2


def test_no_sort_runs_in_the_compiled_selection() -> None:
    """A row past the candidates costs its own bisection: the batch's program holds no sort (one took 2.4 s a
    step at B = 64 over a 152k vocabulary, for every row)."""
    args = (_logits(4, V), _keys(np.arange(4), np.zeros(4)), *_row_params(4, top_k=250).values())
    compiled = select.lower(*args).compile().as_text()
    assert " sort(" not in compiled and "TopK" in compiled


def test_top_k_zero_or_the_vocabulary_is_no_filter() -> None:
    """top_k <= 0 or >= V samples the whole distribution: the same tokens as top_k = -1, seed for seed."""
    logits = _logits(64, V, seed=3)
    keys = _keys(np.arange(64), np.full(64, 2))
    off, _ = select(logits, keys, **_row_params(64, temperature=0.9))
    for top_k in (0, V, V + 5):
        tokens, _ = select(logits, keys, **_row_params(64, temperature=0.9, top_k=top_k))
        np.testing.assert_array_equal(tokens, off, err_msg=f"top_k={top_k}")
    assert len(np.unique(np.asarray(off))) > 30


def test_a_nucleus_smaller_than_the_top_token_keeps_only_it() -> None:
    """top_p below the most likely token's probability: the nucleus is that token alone, on both paths."""
    row = np.full(V, -4.0, np.float32)
    row[[17, 40]] = [2.0, 1.5]  # p(17) ~ 0.43, p(40) ~ 0.26 over V = 300
    logits = jnp.broadcast_to(jnp.asarray(row), (256, V))
    keys = _keys(np.arange(256), np.zeros(256))
    for k_cap in (4, V):  # per-row thresholds, and candidates ranked from the whole vocabulary
        tokens, _ = select(logits, keys, **_row_params(256, temperature=1.0, top_p=0.2), k_cap=k_cap)
        assert set(np.asarray(tokens).tolist()) == {17}
    tokens, _ = select(logits, keys, **_row_params(256, temperature=1.0, top_p=0.45))  # 17 and 40
    assert set(np.asarray(tokens).tolist()) == {17, 40}


def test_different_seeds_and_indices_give_different_tokens() -> None:
    B = 256
    logits = jnp.zeros((B, V), jnp.float32)
    params = _row_params(B)
    by_seed, _ = select(logits, _keys(np.arange(B), np.zeros(B)), **params)
    other_seed, _ = select(logits, _keys(np.arange(B) + 1000, np.zeros(B)), **params)
    other_step, _ = select(logits, _keys(np.arange(B), np.ones(B)), **params)
    again, _ = select(logits, _keys(np.arange(B), np.zeros(B)), **params)
    np.testing.assert_array_equal(by_seed, again)
    # Uniform over V=300: two independent draws agree with probability 1/300.
    assert np.mean(np.asarray(by_seed) == np.asarray(other_seed)) < 0.03
    assert np.mean(np.asarray(by_seed) == np.asarray(other_step)) < 0.03
    assert len(np.unique(np.asarray(by_seed))) > 150


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits/T) truncated to the top-k, then to the top-p nucleus, renormalised."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(probs)]] = True
    probs = np.where(keep, probs, 0.0) / np.sum(np.where(keep, probs, 0.0))
    ranked = probs[order]
    nucleus = (np.cumsum(ranked) - ranked) < top_p
    keep[order[~nucleus]] = False
    return np.where(keep, probs, 0.0) / np.sum(np.where(keep, probs, 0.0))


def _chi2(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(Pearson chi^2 of `counts` against probabilities `expected` over its support, the 1 - 3e-5 quantile
    for that many degrees of freedom by the Wilson-Hilferty approximation). The draws are seeded, so a
    bound this far out still never flakes; it only keeps a passing case far from the edge."""
    allowed = expected > 0
    n = counts.sum()
    chi2 = float(np.sum((counts[allowed] - n * expected[allowed]) ** 2 / (n * expected[allowed])))
    dof = int(allowed.sum()) - 1
    return chi2, dof * (1 - 2 / (9 * dof) + 4.0 * np.sqrt(2 / (9 * dof))) ** 3


def test_temperature_frequencies_match_softmax_and_a_wrong_temperature_does_not() -> None:
    """softmax(logits / T) at T = 0.5, 1, 1.7 over skewed logits (a range of 6 nats): 8000 draws each pass
    the chi^2 bound, and the same draws fail it against T off by 20% either way (the test's power)."""
    V_small, N = 24, 8000
    logit_row = np.random.default_rng(5).normal(0.0, 1.5, V_small)
    temperatures = (0.5, 1.0, 1.7)
    logits = jnp.broadcast_to(jnp.asarray(logit_row, jnp.float32), (len(temperatures) * N, V_small))
    temperature = jnp.repeat(jnp.array(temperatures, jnp.float32), N)
    keys = _keys(np.arange(len(temperatures) * N), np.full(len(temperatures) * N, 3))
    ones = jnp.ones_like(temperature)
    tokens, _ = select(logits, keys, temperature, -ones.astype(jnp.int32), ones)
    for group, t in enumerate(temperatures):
        counts = np.bincount(np.asarray(tokens).reshape(-1, N)[group], minlength=V_small)
        chi2, bound = _chi2(counts, _reference(logit_row, t, -1, 1.0))
        assert chi2 < bound, f"T={t}: chi2={chi2:.1f} >= {bound:.1f}"
        for wrong in (0.8 * t, 1.2 * t):
            chi2, bound = _chi2(counts, _reference(logit_row, wrong, -1, 1.0))
            assert chi2 > bound, f"T={t} draws also fit T={wrong:.2f}: chi2={chi2:.1f} < {bound:.1f}"


@pytest.mark.parametrize("force_sort", [False, True])
def test_empirical_frequencies_match_truncated_distribution(force_sort: bool) -> None:
    """4 configurations × 4000 draws in one call; k_cap=4 of V=16, so a top_k=6 row takes the threshold path."""
    V_small, N, k_cap = 16, 4000, 4
    logit_row = np.linspace(2.0, -1.0, V_small)[np.random.default_rng(2).permutation(V_small)]
    configs = [(1.0, 3, 1.0), (0.8, -1, 0.6), (1.2, 4, 0.7), (1.0, 6 if force_sort else -1, 1.0)]
    # The nucleus of config 1 fits in the top-4 candidates, so without the top_k=6 row every row is capped.
    assert np.sort(_reference(logit_row, 0.8, -1, 1.0))[::-1][:k_cap].sum() > 0.6 + 1e-3
    temperature = jnp.repeat(jnp.array([c[0] for c in configs], jnp.float32), N)
    top_k = jnp.repeat(jnp.array([c[1] for c in configs], jnp.int32), N)
    top_p = jnp.repeat(jnp.array([c[2] for c in configs], jnp.float32), N)
    logits = jnp.broadcast_to(jnp.asarray(logit_row, jnp.float32), (4 * N, V_small))
    keys = _keys(np.arange(4 * N), np.zeros(4 * N))
    tokens, _ = select(logits, keys, temperature, top_k, top_p, k_cap=k_cap)
    tokens = np.asarray(tokens).reshape(4, N)
    for group, (t, k, p) in enumerate(configs):
        expected = _reference(logit_row, t, k, p)
        counts = np.bincount(tokens[group], minlength=V_small)
        assert counts[expected == 0].sum() == 0, f"config {group} sampled a filtered-out token"
        chi2, bound = _chi2(counts, expected)
        assert chi2 < bound, f"config {group}: chi2={chi2:.1f} >= {bound:.1f}"


def test_a_nucleus_just_past_the_candidates_mass_is_drawn_from_its_thresholds() -> None:
    """The top 4 candidates (k_cap) hold 0.59995 of the mass and top_p is 0.6: the nucleus needs a fifth token,
    so the capped candidates cannot serve it; its frequencies are the reference's, fifth token included."""
    probs = np.array([0.2, 0.15, 0.13, 0.11995, 0.1] + [0.30005 / 11] * 11)
    logit_row = np.log(probs)
    N = 4000
    logits = jnp.broadcast_to(jnp.asarray(logit_row, jnp.float32), (N, 16))
    tokens, _ = select(logits, _keys(np.arange(N), np.zeros(N)), **_row_params(N, top_p=0.6), k_cap=4)
    counts = np.bincount(np.asarray(tokens), minlength=16)
    expected = _reference(logit_row, 1.0, -1, 0.6)
    assert expected[4] > 0.14 and counts[4] > 0 and counts[5:].sum() == 0
    chi2, bound = _chi2(counts, expected)
    assert chi2 < bound, f"chi2={chi2:.1f} >= {bound:.1f}"


PIECES = {0: "a", 1: "b", 2: "</", 3: "ans", 4: "wer", 5: ">", 6: "wer>tail", 7: "\n", 9: "<eos>"}
EOS = 9


def _decode(tokens: list[int] | tuple[int, ...]) -> str:
    return "".join(PIECES[t] for t in tokens)


def test_stop_token_is_included_and_later_tokens_dropped() -> None:
    checker = StopChecker([EOS], [], _decode, max_tokens=10)
    assert checker.check([0, 1], num_new=2) is None
    assert checker.check([0, 1, 0, EOS, 1, 1], num_new=4) == Finish(4, "stop")


def test_length_and_stop_at_the_last_allowed_token() -> None:
    one = StopChecker([EOS], ["ab"], _decode, max_tokens=1)
    assert one.check([0], num_new=1) == Finish(1, "length") and one.check([EOS], num_new=1) == Finish(1, "stop")
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        StopChecker([EOS], [], _decode, max_tokens=0)
    strings = StopChecker([], ["ab"], _decode, max_tokens=10)
    assert strings.check([0, 1], num_new=2) == Finish(2, "stop")
    assert strings.check([0, 1], num_new=0) is None  # nothing new since the check that found it
    checker = StopChecker([EOS], [], _decode, max_tokens=4)
    assert checker.check([0, 1, 0, 1, 0, 1], num_new=6) == Finish(4, "length")
    assert checker.check([0, 1, 0, EOS], num_new=4) == Finish(4, "stop")
    assert checker.check([0, 1, 0, 1, EOS], num_new=5) == Finish(4, "length")


def test_stop_string_across_chunks_keeps_the_completing_tokens() -> None:
    checker = StopChecker([], ["</answer>"], _decode, max_tokens=20)
    row = [0, 2, 3]
    assert checker.check(row, num_new=3) is None
    row += [4, 5, 0, 1]
    assert checker.check(row, num_new=4) == Finish(5, "stop")
    assert checker.check([2, 3], num_new=2) is None  # begun at the row's very first token
    assert checker.check([2, 3, 4, 5], num_new=2) == Finish(4, "stop")
    assert checker.check([1, 2, 3, 4, 5, 0], num_new=2) == Finish(5, "stop")  # completed by a chunk's first token
    # Completed inside a token: that whole token stays, text after the string included.
    assert checker.check([1, 2, 3, 6, 0], num_new=5) == Finish(4, "stop")
    # The earliest of a stop string and a stop token wins.
    both = StopChecker([1], ["</answer>"], _decode, max_tokens=20)
    assert both.check([0, 2, 3, 4, 5, 1], num_new=6) == Finish(5, "stop")
    assert both.check([0, 1, 2, 3, 4, 5], num_new=6) == Finish(2, "stop")
    # One byte per token: the decoded window reaches back over every token of the string begun chunks ago.
    spelled = StopChecker([], ["ababab"], _decode, max_tokens=20)
    assert spelled.check([0, 1, 0, 1, 0], num_new=2) is None
    assert spelled.check([0, 1, 0, 1, 0, 1], num_new=1) == Finish(6, "stop")


def test_stop_param_forms() -> None:
    row = [0, EOS, 7, 7, 0]
    assert StopChecker.from_stop_param(None, [EOS], _decode, 5).check(row, 5) == Finish(2, "stop")
    assert StopChecker.from_stop_param([], [EOS], _decode, 5).check(row, 5) == Finish(5, "length")
    assert StopChecker.from_stop_param("\n", [EOS], _decode, 5).check([0, 7, EOS], 3) == Finish(2, "stop")
    assert StopChecker.from_stop_param(["x", "\n"], [EOS], _decode, 5).check(row, 5) == Finish(2, "stop")
    assert StopChecker.from_stop_param([7], [EOS], _decode, 5).check([0, 7, EOS], 3) == Finish(2, "stop")
    with pytest.raises(ValueError):
        StopChecker.from_stop_param(["x", 7], [EOS], _decode, 5)  # type: ignore[list-item]


def test_seeds_are_reproducible_and_distinct() -> None:
    assert resolve_seed(-1, "r") == 2**64 - 1 and resolve_seed(5, "r") == 5
    assert resolve_seed(None, "r") != resolve_seed(None, "r")
    seeds = sample_seeds(5, 64)
    assert seeds == sample_seeds(5, 64) and len(set(seeds)) == 64
    assert all(0 <= s < 2**32 for s in seeds) and seeds[0] != sample_seeds(6, 1)[0]


def test_gumbel_noise_has_the_gumbel_distribution() -> None:
    """The hashed noise behind every sampled token: Gumbel(0, 1) moments and CDF, no correlation between
    neighbouring tokens or between consecutive steps of one row."""

    noise = np.asarray(_gumbel(_keys(np.arange(64), np.zeros(64, np.int32)), 4096), np.float64)
    assert abs(noise.mean() - np.euler_gamma) < 0.01
    assert abs(noise.var() - np.pi**2 / 6) < 0.03
    for q in (0.1, 0.5, 0.9, 0.999):  # empirical CDF at Gumbel quantiles
        assert abs(np.mean(noise <= -np.log(-np.log(q))) - q) < 0.005
    flat = noise.ravel()
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 0.01
    later = np.asarray(_gumbel(_keys(np.arange(64), np.ones(64, np.int32)), 4096), np.float64)
    assert abs(np.corrcoef(noise.ravel(), later.ravel())[0, 1]) < 0.01


def test_gumbel_noise_stays_finite_at_both_ends_of_the_hash() -> None:
    """Rows whose hash reaches its extremes (found by search: seed 8494 hashes token 558 to 0, seed 2530 token
    3755 to all ones) still get finite noise, so the logits decide: u stays strictly inside (0, 1) in float32.
    With 24-bit uniforms the top one rounded to u = 1 and gave +inf noise; its token won at any logit."""

    keys = _keys([8494, 2530], [0, 0])
    noise = np.asarray(_gumbel(keys, 4096))
    assert np.isfinite(noise).all()
    assert noise[0, 558] == noise[0].min() and noise[1, 3755] == noise[1].max()
    np.testing.assert_allclose([noise[0, 558], noise[1, 3755]], [-np.log(24 * np.log(2)), 24 * np.log(2)], rtol=1e-3)
    logits = jnp.full((2, 4096), -30.0).at[:, 0].set(30.0)  # token 0 is e^60 times likelier than any other
    tokens, _ = select(logits, keys, **_row_params(2))
    assert np.asarray(tokens).tolist() == [0, 0]


MASK_32, MASK_64 = 0xFFFFFFFF, (1 << 64) - 1


def _lowbias32(x: int) -> int:
    """Chris Wellons' `lowbias32` integer hash, from its published definition."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK_32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK_32
    return x ^ (x >> 16)


def _splitmix64_first(state: int) -> int:
    """The first output of the splitmix64 generator (Steele, Lea & Flood; Vigna's C reference) from `state`."""
    z = state = (state + 0x9E3779B97F4A7C15) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


def test_the_noise_and_row_seeds_are_the_documented_hashes_on_any_platform() -> None:
    """A logged seed replays a sample on any machine only if the noise is exactly the documented integer
    construction: lowbias32 of the row key's data, then of (row hash ^ token index * 0x9E3779B9), the top
    23 bits as u, Gumbel -log(-log u); and row seeds are splitmix64 outputs. Both against Python integers."""

    assert _splitmix64_first(0) == 0xE220A8397B1DCDAF  # splitmix64's published first output from state 0
    for seed in (0, 5, 2**63 + 12345, 2**64 - 1):
        first = _splitmix64_first(seed)
        assert sample_seeds(seed, 4) == [_splitmix64_first(first ^ i) & MASK_32 for i in range(4)]
    keys = _keys([0, 1, 2**32 - 1, 77], [0, 3, 7, 2**20])
    data = np.asarray(jax.random.key_data(keys)).astype(np.uint64)
    expected = np.zeros((4, 64))
    for b in range(4):
        row = _lowbias32(int(data[b, 0]) ^ _lowbias32(int(data[b, 1])))
        for j in range(64):
            u = ((_lowbias32(row ^ ((j * 0x9E3779B9) & MASK_32)) >> 9) + 0.5) / 2**23
            expected[b, j] = -np.log(-np.log(u))
    np.testing.assert_allclose(np.asarray(_gumbel(keys, 64)), expected, rtol=1e-4, atol=1e-5)


def test_a_drawn_seed_is_a_64_bit_value() -> None:
    drawn = [resolve_seed(None, i) for i in range(200)]
    assert all(0 <= s < 2**64 for s in drawn) and max(drawn) >= 2**62  # and not a narrower one


def test_which_rows_filter_and_when_the_candidates_cover_them() -> None:
    """The path decision, whose two outcomes draw alike by design (so no draw can tell them apart): a top-k
    equal to the vocabulary or a top-p of 1 and above filters nothing; the top-k_cap candidates serve a row
    whose top-k is within the cap, or whose nucleus ends at least the margin inside their mass."""
    from tx.engine.sampling import _MASS_MARGIN, _capped_covers, _filters

    filters = _filters(jnp.array([0, 5, 16, 17, 0, 0, 0]), jnp.array([1.0, 1.0, 1.0, 1.0, 0.999, 1.5, 2.0]), 16)
    assert np.asarray(filters.k_on).tolist() == [False, True, False, False, False, False, False]
    assert np.asarray(filters.top_k).tolist() == [16, 5, 16, 16, 16, 16, 16]
    assert np.asarray(filters.p_on).tolist() == [False, False, False, False, True, False, False]
    top_p = jnp.array([0.5, 0.5, 0.5, 0.9], jnp.float32)
    nucleus = _filters(jnp.zeros(4, jnp.int32), top_p, 300)
    cap_mass = jnp.array([0.5, 0.5 + 1e-5, 0.5, 0.99], jnp.float32).at[2].set(top_p[2] + _MASS_MARGIN)
    assert np.asarray(_capped_covers(cap_mass, nucleus, 64)).tolist() == [False, False, True, True]
    by_k = _filters(jnp.array([64, 65, 0]), jnp.array([0.1, 0.1, 1.0]), 300)
    assert np.asarray(_capped_covers(jnp.full(3, 0.01), by_k, 64)).tolist() == [True, False, False]


@pytest.mark.parametrize("vocab", [7, 300, 1024, 1031])
def test_the_chunked_noisy_argmax_is_the_argmax_of_the_whole_noisy_row(vocab: int) -> None:
    """`_noisy_argmax` (chunk maxima, then the winning chunk) picks what argmax over the whole [B, V] row
    of logits / T + noise picks, greedy rows their logits' first maximum (ties across chunk borders too),
    for a vocabulary of one chunk per token, a composite one, a power of two and a prime."""
    from tx.engine.sampling import _noisy_argmax, _row_hash

    B = 6
    logits = np.array(_logits(B, vocab, seed=vocab))
    logits[4] = 0.0
    logits[4, [vocab // 2, vocab - 1]] = 3.0  # a tie: the first index wins
    temperature = jnp.array([1.0, 0.5, 2.0, 1.0, 0.0, 0.0])
    keys = _keys(np.arange(B) + 40, np.arange(B))
    greedy = temperature <= 0
    inv_t = 1.0 / jnp.where(greedy, 1.0, temperature)
    whole = jnp.where(greedy[:, None], logits, logits * inv_t[:, None] + _gumbel(keys, vocab))
    got = jax.jit(_noisy_argmax)(jnp.asarray(logits), inv_t, _row_hash(keys), greedy)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(whole, axis=-1)))
    assert int(got[4]) == vocab // 2
