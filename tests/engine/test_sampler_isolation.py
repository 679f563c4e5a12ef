"""One tenant's overflowing rows leave nothing that another tenant's rows read: a decode row reads every
cache position with weight 0 past its own, so a non-finite value a previous occupant (or the row it was
copied from when the cache grew) stored there would make 0 * inf = NaN of the next occupant's output."""

from __future__ import annotations

import numpy as np
import pytest
from test_sampler import LORA_SLOT, PROMPTS, Setup, make_req, run, tokens_of

HUGE_SLOT = 1  # scale 1 like LORA_SLOT, its adapter zero until the test fills it


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("qwen-isolation"), "qwen3", True, lora=True)


def test_a_row_that_overflowed_leaves_nothing_the_rows_after_it_read(qwen: Setup) -> None:
    other = make_req(PROMPTS[3], 10, temperature=0.0)
    alone, _ = run(qwen.new_sampler(), {"b": (other, LORA_SLOT)})
    clean = dict(qwen.weights)
    for path, value in clean.items():  # slot 1's adapter trained to 1e38 (finite): its rows' keys overflow
        if path[-1] in ("lora_a", "lora_b"):
            qwen.weights[path] = value.at[..., HUGE_SLOT, :, :].set(1e38)
    try:
        sampler = qwen.new_sampler()
        sampler.submit("a", make_req(PROMPTS[2], 44, temperature=0.0), HUGE_SLOT)
        finished: dict = {}
        for _ in range(7):  # row 0 writes past the other request's prefill bucket
            finished.update(sampler.step())
        sampler.submit("b", other, LORA_SLOT)  # the cache grows: its new rows start as copies of row 0
        while not sampler.idle():
            finished.update(sampler.step())
    finally:
        qwen.weights.update(clean)
    assert tokens_of(finished["b"]) == tokens_of(alone["b"])
    got, want = finished["b"].sequences[0].logprobs, alone["b"].sequences[0].logprobs
    np.testing.assert_allclose(got, want, atol=1e-5)
