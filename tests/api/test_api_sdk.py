"""The real tinker SDK (0.38) against a real server: bootstrap, training, sampling, futures."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from api.harness import KEY, MODEL, Server
from tx.db import owner_of


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": np.ones(len(tokens) - 1)},
    )


def test_capabilities(server: Server) -> None:
    caps = tinker.RestClient(base_url=server.url, api_key=KEY).get_server_capabilities().result()
    assert caps.supported_models[0].model_name == MODEL.base_model


def test_create_lora_training_client_model_id_and_info(training) -> None:
    info = training.get_info()
    assert info.model_id.count(":train:") == 1
    assert info.model_data.model_name == MODEL.base_model
    assert info.model_data.tokenizer_id == MODEL.tokenizer_id
    assert info.lora_rank == 8


def test_forward_backward_protobuf_roundtrip(training) -> None:
    data = [_datum([1, 2, 3, 4, 5]), _datum([7, 8, 9])]
    out = training.forward_backward(data, "cross_entropy").result()
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[4], [2]]
    expected = -(np.array([2, 3, 4, 5]) % 7) / 10
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected, rtol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(float(sum(np.array([2, 3, 4, 5, 8, 9]) % 7) / 10), rel=1e-5)


def test_forward_only_and_optim_step(training, server: Server) -> None:
    fwd = training.forward([_datum([3, 4, 5])], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-3))
    assert fwd.result().loss_fn_outputs[0]["logprobs"].shape == [2]
    assert step.result().metrics == {"grad_norm:mean": 1.0}
    kinds = [item.kind for item in server.runner.seen[-2:]]
    assert kinds == ["forward", "optim_step"]


def test_rl_loss_with_config(training) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4]),
            "logprobs": np.array([-1.0, -1.0, -1.0], dtype=np.float32),
            "advantages": np.array([0.5, 0.5, 0.5], dtype=np.float32),
        },
    )
    out = training.forward_backward([datum], "ppo", loss_fn_config={"clip_low_threshold": 0.7}).result()
    assert out.loss_fn_outputs[0]["logprobs"].shape == [3]


def test_sample_with_sequence_ids(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=MODEL.base_model).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=3, temperature=0.7)
    response = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
    assert len(response.sequences) == 4
    assert len({s.sequence_id for s in response.sequences}) == 4
    assert response.sequences[1].tokens == [8, 9, 10]
    assert response.sequences[0].stop_reason == "length"


def test_prompt_logprobs(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=MODEL.base_model).result()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7, 8])).result()
    assert logprobs[0] is None and logprobs[1:] == [-1.0, -1.0, -1.0]
    resp = sampler.sample(
        types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()  # fmt: skip
    assert resp.topk_prompt_logprobs[0] is None
    assert resp.topk_prompt_logprobs[1] == [(0, pytest.approx(-0.1)), (1, pytest.approx(-0.2))]


def test_save_state_sampler_and_resume(service: tinker.ServiceClient, training) -> None:
    path = training.save_state("ckpt-a").result().path
    assert path.endswith("/weights/ckpt-a") and path.startswith("tinker://")
    sampler_path = training.save_weights_for_sampler("samp-a").result().path
    assert sampler_path.endswith("/sampler_weights/samp-a")
    sampler = training.save_weights_and_get_sampling_client().result()
    assert (
        len(
            sampler.sample(types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=2)).result().sequences
        )
        == 2
    )
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 8
    assert resumed.model_id != training.model_id
    from_named = service.create_sampling_client(model_path=sampler_path).result()
    assert from_named.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result()


def test_rest_listing_and_delete(server: Server, training) -> None:
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    training.save_state("to-delete").result()
    runs = rest.list_training_runs().result()
    assert training.model_id in [r.training_run_id for r in runs.training_runs]
    ids = [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert "weights/to-delete" in ids
    rest.delete_checkpoint(training.model_id, "weights/to-delete").result()
    ids = [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert "weights/to-delete" not in ids
    info = rest.get_weights_info_by_tinker_path(f"tinker://{training.model_id}/weights/ckpt-a").result()
    assert info.lora_rank == 8 and info.base_model == MODEL.base_model


def test_request_failure_is_request_failed_error(training) -> None:
    with pytest.raises(tinker.RequestFailedError, match="token 998 is not allowed"):
        training.forward_backward([_datum([998, 2, 3])], "cross_entropy").result()


def test_runner_exception_fails_only_that_request(training) -> None:
    bad = training.forward_backward([_datum([999, 2, 3])], "cross_entropy")
    with pytest.raises(tinker.RequestFailedError, match="fake runner exploded"):
        bad.result()
    assert training.forward_backward([_datum([1, 2, 3])], "cross_entropy").result().metrics["loss:sum"] > 0


def test_session_finish_with_context_manager(server: Server) -> None:
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as client:
        client.create_lora_training_client(base_model=MODEL.base_model, rank=4, seed=0).result()
        session_id = client.holder.get_session_id()
    row = server.db.records.get_session(session_id, owner_of(KEY))
    assert row is not None and row.status == "finished" and row.finish_reason == "success"
