"""The sampler's host bookkeeping on its own: which jobs want prompt scores, one-token prompts' results,
the cache reach of a row, the prefill shape of a batch, and which rows copy a prefilled prompt."""

from __future__ import annotations

import numpy as np

from tx.engine.batching import DEFAULT_BUCKETS, LENGTH_BUCKETS
from tx.engine.sampler_rows import Job, Row, copy_sources, decode_rows, prefill_batch
from tx.engine.sampling import StopChecker
from tx.protocol import SampledSequence, SampleRequest, SamplingParams


def _job(prompt: list[int], max_tokens: int = 4, **scores: object) -> Job:
    req = SampleRequest(prompt, 1, SamplingParams(max_tokens=max_tokens), "m", **scores)  # type: ignore[arg-type]
    return Job("r", req, slot=0, seeds=[0], stop=StopChecker([], [], lambda ids: "", max_tokens))


def test_any_prompt_score_request_wants_scores_once() -> None:
    assert not _job([1, 2, 3]).wants_prompt_scores()
    assert _job([1, 2, 3], prompt_logprobs=True).wants_prompt_scores()
    top1 = _job([1, 2, 3], topk_prompt_logprobs=1)
    assert top1.wants_prompt_scores()
    top1.score_prompt(np.array([-0.1, -0.2]), np.array([[2, 9], [3, 9]]), np.array([[-0.1, -3.0], [-0.2, -3.0]]))
    assert not top1.wants_prompt_scores()
    assert top1.prompt_logprobs is None  # it asked for the top tokens only
    assert top1.topk_prompt_logprobs.ids[1:].tolist() == [[2], [3]]  # cut to its k
    np.testing.assert_array_equal(top1.topk_prompt_logprobs.logprobs[1:], np.float32([[-0.1], [-0.2]]))


def test_a_one_token_prompt_scores_only_its_undefined_first_entry() -> None:
    done = SampledSequence([7], [-0.5], "length")
    plain, scored, topk = _job([5]), _job([5], prompt_logprobs=True), _job([5], topk_prompt_logprobs=2)
    for job in (plain, scored, topk):
        job.sequences[0] = done
    assert (plain.result().prompt_logprobs, plain.result().topk_prompt_logprobs) == (None, None)
    assert np.isnan(scored.result().prompt_logprobs).tolist() == [True] and scored.result().topk_prompt_logprobs is None
    assert topk.result().prompt_logprobs is None and topk.result().topk_prompt_logprobs.ids.shape == (1, 2)


def test_a_row_reaches_no_further_than_its_last_useful_position() -> None:
    row = Row.start(_job([1, 2, 3, 4, 5], max_tokens=3), 0)  # feeds the last prompt token at position 4
    assert row.position == 4
    assert [row.need(steps) for steps in (1, 2, 3, 16)] == [5, 6, 7, 7]  # 5 + 3 - 1: the last token's slot


def test_prefill_shapes_fit_the_prompt_less_its_last_token() -> None:
    for length, width in ((129, 128), (130, 192)):  # the last token is fed by the first decode step
        batch, slots = prefill_batch([_job(list(range(1, length + 1)))], DEFAULT_BUCKETS, LENGTH_BUCKETS)
        assert batch.tokens.shape == (1, width) and slots.tolist() == [0]
        np.testing.assert_array_equal(batch.tokens[0, : length - 1], np.arange(1, length))
        np.testing.assert_array_equal(batch.targets[0, : length - 1], np.arange(2, length + 1))


def test_only_newly_admitted_rows_copy_their_prefilled_prompt() -> None:
    old_job, new_job = _job([1, 2, 3]), _job([4, 5, 6])
    old, new = Row.start(old_job, 0), Row.start(new_job, 0)
    pieces = {id(old_job): 0, id(new_job): 1}
    assert copy_sources([old, None, new], [new], pieces).tolist() == [-1, -1, 1]
    assert copy_sources([new], [new], {}).tolist() == [-1]  # its prompt came from the prompt cache


def test_a_temperature_too_small_to_divide_by_samples_greedily() -> None:
    """2e-38 passed validation (finite, >= 0), and 1 / T = 5e37 sent every logit above ~7 to +inf, so the
    arg-max picked the lowest such token id instead of the largest logit."""
    rows = []
    for temperature in (2e-38, 9.9e-6, 1e-5, 0.7, 0.0):
        req = SampleRequest([1, 2], 1, SamplingParams(max_tokens=2, temperature=temperature), "m")
        rows.append(Row.start(Job("r", req, slot=0, seeds=[0], stop=StopChecker([], [], lambda ids: "", 2)), 0))
    temperatures = decode_rows([*rows, None], 8).temperature
    np.testing.assert_array_equal(temperatures, np.array([0.0, 0.0, 1e-5, 0.7, 0.0, 0.0], np.float32))


def test_a_prompt_top_k_past_the_vocabulary_keeps_what_the_scores_hold() -> None:
    """The scored prefill is no wider than the vocabulary: a request asking for more keeps every token's
    score (its k columns cut to the vocabulary) instead of raising, which failed every request in the batch."""
    req = SampleRequest([1, 2, 3], 1, SamplingParams(max_tokens=1), "m", prompt_logprobs=True, topk_prompt_logprobs=5)
    job = Job("r", req, 0, [0], StopChecker([], [], lambda ids: "", 1))
    ids, top = np.array([[2, 0, 1], [0, 2, 1]], np.int32), np.log(np.full((2, 3), 1 / 3, np.float32))
    job.score_prompt(np.zeros(2, np.float32), ids, top)
    assert job.topk_prompt_logprobs is not None
    assert job.topk_prompt_logprobs.ids.shape == (3, 3) and job.topk_prompt_logprobs.ids[1:].tolist() == ids.tolist()
