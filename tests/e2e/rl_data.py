"""The RL loop's batch for e2e tests: a run samples its current weights and trains on what it sampled."""

from __future__ import annotations

from typing import Any

import numpy as np
from tinker import types


def rl_batch(client: Any, prompt: list[int], seed: int = 5) -> list[types.Datum]:
    """An importance_sampling batch from the run's own seeded samples: reward 1 for an odd first token,
    advantages = reward - mean on the sampled positions, the sampler's logprobs as the old policy's."""
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    rewards = np.array([float(seq.tokens[0] % 2) for seq in seqs])
    data = []
    for seq, adv in zip(seqs, rewards - rewards.mean(), strict=True):
        tokens = prompt + seq.tokens
        lp = np.zeros(len(tokens) - 1, np.float32)
        lp[len(prompt) - 1 :] = seq.logprobs
        advantages = np.where(np.arange(len(tokens) - 1) >= len(prompt) - 1, adv, 0.0).astype(np.float32)
        inputs = {"target_tokens": np.asarray(tokens[1:], np.int64), "logprobs": lp, "advantages": advantages}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data
