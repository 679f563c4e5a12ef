"""Full fine-tuning through the SDK: rank 0 trains every weight, samples from its own copy, exports HF weights."""

import numpy as np
import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from e2e.test_sdk_loops import sl_batch

pytestmark = pytest.mark.e2e


def test_full_finetune_trains_samples_and_exports(live, service):
    client = service.create_lora_training_client(base_model=live.base_model, rank=0).result()
    assert client.get_info().lora_rank in (None, 0)
    batch = sl_batch(7)
    prompt = types.ModelInput.from_ints(batch[0].model_input.to_ints()[:5])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    before = client.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result()
    losses = []
    for _ in range(5):
        losses.append(client.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    assert losses[-1] < losses[0]
    sampler = client.save_weights_and_get_sampling_client().result()
    after = sampler.sample(prompt, 1, greedy).result()
    # the base model (another client's view) is untouched by full fine-tuning
    base = service.create_sampling_client(base_model=live.base_model).sample(prompt, 1, greedy).result()
    assert base.sequences[0].tokens == before.sequences[0].tokens
    assert after.sequences[0].logprobs != pytest.approx(before.sequences[0].logprobs, abs=1e-3), "sync saw no update"

    path = client.save_weights_for_sampler("full-final").result().path
    run_id, name = path.removeprefix("tinker://").split("/", 1)
    directory = next(live.data_dir.rglob(name.split("/")[-1]))
    exported = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = batch[0].model_input.to_ints()
    ours = client.forward([batch[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    with torch.no_grad():
        logits = exported(torch.tensor([tokens])).logits[0]
    targets = torch.tensor(batch[0].loss_fn_inputs["target_tokens"].tolist())
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    # the synced sampler sampled exactly these weights: the exported model's greedy continuation and logprobs
    seq, context = after.sequences[0], prompt.to_ints()
    with torch.no_grad():
        for token, logprob in zip(seq.tokens, seq.logprobs, strict=True):
            step_lp = torch.log_softmax(exported(torch.tensor([context])).logits[0, -1], -1)
            assert token == int(step_lp.argmax())
            np.testing.assert_allclose(logprob, float(step_lp[token]), atol=1e-4)
            context.append(token)


def test_full_snapshots_are_bounded_and_named_ones_reload(live, service):
    """Each full fine-tuning snapshot is a whole copy of the weights: the server keeps the two most recently
    used; an evicted ephemeral one is reported as gone, an evicted named one reloads from its checkpoint."""
    client = service.create_lora_training_client(base_model=live.base_model, rank=0).result()
    prompt = types.ModelInput.from_ints(sl_batch(3)[0].model_input.to_ints()[:5])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    ephemeral = client.save_weights_and_get_sampling_client().result()
    first = ephemeral.sample(prompt, 1, greedy).result().sequences[0].tokens
    path = client.save_weights_for_sampler("keep-me").result().path  # written to disk
    named = service.create_sampling_client(model_path=path)
    for _ in range(2):  # two newer snapshots push both older ones out
        client.forward_backward(sl_batch(3), "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        client.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result()
    with pytest.raises(Exception, match="not available"):
        ephemeral.sample(prompt, 1, greedy).result()
    assert named.sample(prompt, 1, greedy).result().sequences[0].tokens == first  # reloaded from disk
