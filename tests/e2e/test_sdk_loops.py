"""Unmodified tinker SDK 0.38 against the real server and engine: SL, RL, checkpoints, sampling."""

import numpy as np
import pytest
import tinker
import torch
from tinker import types

pytestmark = pytest.mark.e2e


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def sl_batch(seed: int = 0) -> list[types.Datum]:
    rng = np.random.RandomState(seed)
    return [datum(rng.randint(0, 256, int(rng.randint(8, 24))).tolist()) for _ in range(4)]


def test_sl_loop_forward_parity_and_checkpoint_resume(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=8, seed=0).result()
    batch = sl_batch()
    fwd = client.forward(batch, "cross_entropy").result()
    with torch.no_grad():
        for d, out in zip(batch, fwd.loss_fn_outputs, strict=True):
            tokens = d.model_input.to_ints()
            logits = live.torch_model(torch.tensor([tokens])).logits[0]
            ref = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())[:, None]
            )
            np.testing.assert_allclose(out["logprobs"].to_numpy(), ref[:, 0].numpy(), atol=1e-4)
    losses = []
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(10):
        result = client.forward_backward(batch, "cross_entropy").result()
        losses.append(result.metrics["loss:sum"])
        client.optim_step(adam).result()
    assert losses[-1] < 0.7 * losses[0], losses

    path = client.save_state("step10").result().path
    assert path.startswith("tinker://")
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    a = client.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
    b = resumed.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
    np.testing.assert_allclose(a, b, rtol=1e-5)
    client.optim_step(adam).result(), resumed.optim_step(adam).result()
    a = client.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    b = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_custom_loss(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=4, seed=0).result()
    batch = sl_batch(3)

    def loss_fn(data, logprobs_list):
        loss = sum((-lp).sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss)}

    out = client.forward_backward_custom(batch, loss_fn).result()
    plain = client.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    np.testing.assert_allclose(out.metrics["loss:sum"], plain, rtol=1e-4)


def test_rl_loop_reward_rises(live, service):
    """Toy task: reward = fraction of sampled tokens below 128. Importance sampling should raise it."""
    # seeded adapter: an unseeded run's A is drawn from its (random) id, and lr 5e-2 collapses some draws
    client = service.create_lora_training_client(base_model=live.base_model, rank=8, seed=0).result()
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    rewards = []
    for step in range(8):
        sampler = client.save_weights_and_get_sampling_client().result()
        # seeded: the same rollouts on every run and backend, so the assertion below never flakes
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1234 + step)
        result = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        assert len(result.sequences) == 8
        data, step_rewards = [], []
        for seq in result.sequences:
            r = float(np.mean(np.asarray(seq.tokens) < 128))
            step_rewards.append(r)
        mean = float(np.mean(step_rewards))
        rewards.append(mean)
        for seq, r in zip(result.sequences, step_rewards, strict=True):
            tokens = prompt.to_ints() + list(seq.tokens)
            n = len(tokens) - 1
            adv = np.zeros(n, np.float32)
            adv[len(prompt.to_ints()) - 1 :] = r - mean
            lp = np.zeros(n, np.float32)
            lp[len(prompt.to_ints()) - 1 :] = seq.logprobs
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.asarray(tokens[1:], np.int64),
                        "logprobs": lp,
                        "advantages": adv,
                    },
                )
            )
        client.forward_backward(data, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]), rewards


def test_stable_reinforce_with_provenance(live, service):
    """The cookbook's rl_loop step: record_stability_info sampler, provenance spans, stable_reinforce loss."""
    client = service.create_lora_training_client(base_model=live.base_model, rank=4, seed=0).result()
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    result = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4)).result()
    data = []
    for seq in result.sequences:
        assert seq.sequence_id
        sampled, ob_len = list(seq.tokens), prompt.length - 1
        datum = types.Datum(
            model_input=prompt.append(types.EncodedTextChunk(tokens=sampled[:-1])),
            loss_fn_inputs={
                "target_tokens": np.asarray([0] * ob_len + sampled, np.int64),
                "logprobs": np.asarray([0.0] * ob_len + list(seq.logprobs), np.float32),
                "advantages": np.asarray([0.0] * ob_len + [1.0] * len(sampled), np.float32),
            },
        )
        data.append(
            datum.with_provenance(
                model_input=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=prompt.length),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled) - 1),
                ],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=prompt.length - 1),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled)),
                ],
            )
        )
    out = client.forward_backward(data, "stable_reinforce").result()
    # the loss with the default config (truncation 2, no KL term), from the learner logprobs it returned
    expected = 0.0
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        p, q = o["logprobs"].to_numpy(), d.loss_fn_inputs["logprobs"].to_numpy()
        adv = d.loss_fn_inputs["advantages"].to_numpy()
        expected += float(np.sum(-np.minimum(np.exp(p - q), 2.0) * adv * p))
    np.testing.assert_allclose(out.metrics["loss:sum"], expected, rtol=1e-4)
    # the sampler and the learner hold the same weights: on-policy, the sampled tokens' logprobs agree
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        sampled = d.loss_fn_inputs["advantages"].to_numpy() != 0
        p, q = o["logprobs"].to_numpy(), d.loss_fn_inputs["logprobs"].to_numpy()
        np.testing.assert_allclose(p[sampled], q[sampled], atol=1e-4)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # positive advantages on every sampled token: the step makes those tokens more likely
    after = client.forward(data, "stable_reinforce").result().loss_fn_outputs
    for d, before, now in zip(data, out.loss_fn_outputs, after, strict=True):
        sampled = d.loss_fn_inputs["advantages"].to_numpy() != 0
        assert now["logprobs"].to_numpy()[sampled].sum() > before["logprobs"].to_numpy()[sampled].sum()


def test_bad_input_is_a_clear_error(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=4, seed=0).result()
    bad = datum([1, 2, 10_000])
    with pytest.raises(Exception, match="vocab|10000"):
        client.forward_backward([bad], "cross_entropy").result()
    # the server keeps serving
    assert client.forward(sl_batch(1), "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.TinkerError):
        client.forward_backward(sl_batch(1), "no_such_loss").result()
