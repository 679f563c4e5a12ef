"""End to end with the real JAX runner: tinker SDK -> HTTP -> queue -> engine -> tiny Qwen3 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from api.harness import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_train_save_sample_resume(hf_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tx.engine import AdapterConfig, EngineConfig, build_runner
    from tx.engine.sampler import SamplerConfig

    model_dir, _ = hf_models()
    runner, info = build_runner(
        EngineConfig(base_model=str(model_dir), data_dir=tmp_path, dtype="float32",
            adapters=AdapterConfig(4, 8), sampler=SamplerConfig(max_rows=4, max_seq_len=64))
    )  # fmt: skip
    with running_server(runner, info, tmp_path) as (url, _db):
        with tinker.ServiceClient(base_url=url, api_key="tml-e2e") as service:
            training = service.create_lora_training_client(base_model=info.base_model, rank=4, seed=0).result()
            tokens = [1, 2, 3, 4, 5, 6]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(5, np.float32)},
            )
            losses = []
            for _ in range(2):
                fb = training.forward_backward([datum], "cross_entropy")
                training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                losses.append(fb.result().metrics["loss:sum"])
            assert losses[1] < losses[0]
            path = training.save_state("e2e").result().path
            saved = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            sampler = training.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=4, seed=1)
            sample = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result()
            assert [len(s.tokens) for s in sample.sequences] == [4, 4]
            resumed = service.create_training_client_from_state_with_optimizer(path).result()
            out = resumed.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(out, saved, rtol=1e-6, atol=1e-6)  # the trained weights, not a fresh adapter
            # the optimizer state came back too: one more identical step keeps the two runs equal
            for client in (training, resumed):
                client.forward_backward([datum], "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            a, b = (c.forward([datum], "cross_entropy").result().metrics["loss:sum"] for c in (training, resumed))
            np.testing.assert_allclose(a, b, rtol=1e-5)
            # Weights only: the optimizer starts afresh, as the SDK documents ("optimizer resets"). The run's
            # moments of the steps trained since the save were kept, and its next step moved 2.8 nats away
            # from a run created from the same state.
            training.load_state(path).result()
            fresh = service.create_training_client_from_state(path).result()
            for client in (training, fresh):
                client.forward_backward([datum], "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            logprobs = [c.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
                        for c in (training, fresh)]  # fmt: skip
            np.testing.assert_allclose(logprobs[0], logprobs[1], rtol=1e-5, atol=1e-6)
