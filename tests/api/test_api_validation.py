"""Bad input is rejected before queueing, with a message naming the field and the limit."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from api.harness import KEY, MODEL, PROTO, Server, proto_body
from tx.protocol import SampleRequest


@pytest.fixture(scope="module")
def ids(http: httpx.Client) -> dict[str, str]:
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL.base_model, "lora_config": {"rank": 4}}
    http.post("/create_model", json=body)
    sampler = http.post("/create_sampling_session", json={"session_id": session_id, "base_model": MODEL.base_model})
    return {"session": session_id, "model": f"{session_id}:train:0", "sampler": sampler.json()["sampling_session_id"]}


def _fb(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/forward_backward", content=body, headers=PROTO)


def _assert_400(reply: httpx.Response, *fragments: str) -> None:
    assert reply.status_code == 400, reply.text
    for fragment in fragments:
        assert fragment in reply.json()["detail"]


def test_token_outside_vocabulary(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1, 1000, 2])), "token id 1000 at position 1", "[0, 1000)")


def test_target_outside_vocabulary(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1, 2], [1, -1])), "target_tokens", "outside the vocabulary")


def test_sequence_too_long(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1] * 129)), "129 tokens", "maximum length 128")


def test_ragged_loss_inputs(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1, 2, 3], [1, 2])), "target_tokens has length 2", "3 tokens")


def test_unknown_loss(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1, 2], loss_fn="hinge")), "unknown loss_fn 'hinge'", "ppo")


def test_unknown_loss_config_key(http: httpx.Client, ids: dict[str, str]) -> None:
    body = proto_body(ids["model"], 1, [1, 2], loss_fn="cross_entropy", clip_low_threshold=0.5)
    _assert_400(_fb(http, body), "loss_fn_config", "'clip_low_threshold' for loss 'cross_entropy'; allowed keys: none")


def test_missing_rl_inputs(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_fb(http, proto_body(ids["model"], 1, [1, 2], loss_fn="ppo")), "missing ['advantages', 'logprobs']")


def test_image_chunk_rejected(http: httpx.Client, ids: dict[str, str]) -> None:
    request = pb.ForwardBackwardRequest(model_id=ids["model"], seq_id=1, loss_fn="cross_entropy")
    request.data.add().model_input.add().image.data = b"\x89PNG"
    message = "image input is not supported yet for this model"
    _assert_400(_fb(http, request.SerializeToString()), "data[0].model_input", message)


def test_malformed_protobuf(http: httpx.Client) -> None:
    _assert_400(_fb(http, b"\xff\xff\xff"), "not a valid ForwardBackwardRequest")


def test_malformed_json(http: httpx.Client) -> None:
    _assert_400(http.post("/forward_backward", content=b"{nope", headers={"Content-Type": "application/json"}), "JSON")
    reply = http.post("/optim_step", json={"adam_params": {}})
    assert reply.status_code == 422 and "model_id" in reply.text


def test_unknown_model(http: httpx.Client) -> None:
    reply = _fb(http, proto_body("nope:train:0", 1, [1, 2]))
    assert reply.status_code == 404 and "unknown model_id 'nope:train:0'" in reply.json()["detail"]


def test_rank_over_limit(http: httpx.Client, ids: dict[str, str]) -> None:
    body = {
        "session_id": ids["session"],
        "model_seq_id": 5,
        "base_model": MODEL.base_model,
        "lora_config": {"rank": 64},
    }
    _assert_400(http.post("/create_model", json=body), "rank 64", "[1, 32]")


def test_unknown_base_model(http: httpx.Client, ids: dict[str, str]) -> None:
    body = {"session_id": ids["session"], "model_seq_id": 6, "base_model": "other/model"}
    _assert_400(http.post("/create_model", json=body), "unknown base_model 'other/model'", MODEL.base_model)


def test_unknown_checkpoint(http: httpx.Client, ids: dict[str, str]) -> None:
    body = {"session_id": ids["session"], "model_seq_id": 7, "path": f"tinker://{ids['model']}/weights/none"}
    reply = http.post("/load_weights", json=body)
    assert reply.status_code == 404 and "unknown checkpoint" in reply.json()["detail"]
    _assert_400(http.post("/load_weights", json={**body, "path": "s3://x"}), "not a checkpoint path")


def test_bad_checkpoint_name(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(http.post("/save_weights", json={"model_id": ids["model"], "path": "a b", "seq_id": 50}), "'a b'")


def _sample(http: httpx.Client, ids: dict[str, str], **overrides: Any) -> httpx.Response:
    body = {
        "sampling_session_id": ids["sampler"],
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4},
    }
    return http.post("/asample", json={**body, **overrides})


def test_sample_limits(http: httpx.Client, ids: dict[str, str]) -> None:
    _assert_400(_sample(http, ids, sampling_params={"max_tokens": 127}), "= 130 exceeds the maximum length 128")
    assert _sample(http, ids, sampling_params={"max_tokens": 126}).status_code == 200  # 3 + 126 - 1 positions
    _assert_400(_sample(http, ids, num_samples=0), "num_samples 0")
    _assert_400(
        _sample(http, ids, prompt={"chunks": [{"type": "encoded_text", "tokens": [5000]}]}), "prompt: token id 5000"
    )
    _assert_400(_sample(http, ids, prompt_alt_tokens_k=2), "prompt_alt_tokens_k is not supported")
    _assert_400(_sample(http, ids, prompt_logprobs_last_n=1), "prompt_logprobs_last_n needs prompt_logprobs")
    scored = {"prompt_logprobs": True}  # the prompt has 3 tokens: at most 2 can be scored
    _assert_400(_sample(http, ids, prompt_logprobs_last_n=3, **scored), "prompt_logprobs_last_n 3 is outside [1, 2]")
    _assert_400(_sample(http, ids, prompt_logprobs_last_n=0, **scored), "prompt_logprobs_last_n 0 is outside [1, 2]")
    _assert_400(_sample(http, ids, sampling_params={"max_tokens": 2, "stop": [2000]}), "sampling_params.stop")


def test_sample_counts_are_checked_before_any_per_sample_work(http: httpx.Client, ids: dict[str, str]) -> None:
    """A billion samples is refused at once: nothing is built per sample before num_samples is checked
    (the sample ids once were, and such a request held the server's memory and a worker for minutes)."""
    _assert_400(_sample(http, ids, seq_id=91, num_samples=10**9), "num_samples 1000000000 is outside [1, ")
    _assert_400(_sample(http, ids, seq_id=92, topk_sample_logprobs=-1), "topk_sample_logprobs must be >= 0, got -1")
    _assert_400(_sample(http, ids, seq_id=93, prompt_alt_tokens_k=-2), "prompt_alt_tokens_k must be >= 0, got -2")


def test_unset_max_tokens_fills_what_the_prompt_leaves(server: Server, http: httpx.Client, ids: dict[str, str]) -> None:
    """Without max_tokens a sample runs to the default (512) or to the model's length, whichever comes first:
    a 125-token prompt on a 128-token model may add 3 (the whole sequence then fits a prompt again), not fail
    for 125 + 512; an explicit 4 is allowed (the last token drawn takes no position), 5 is not."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1] * 125}]}
    for seq_id, params in ((94, {}), (95, {"max_tokens": None})):
        reply = _sample(http, ids, seq_id=seq_id, prompt=prompt, sampling_params=params)
        assert reply.status_code == 200, reply.text
        http.post("/retrieve_future", json={"request_id": reply.json()["request_id"]})  # long-polls until run
        item = next(i for i in server.runner.seen if i.model_id == ids["sampler"] and i.seq_id == seq_id)
        assert isinstance(item.payload, SampleRequest) and item.payload.params.max_tokens == 3
    assert _sample(http, ids, seq_id=97, prompt=prompt, sampling_params={"max_tokens": 4}).status_code == 200
    _assert_400(_sample(http, ids, seq_id=96, prompt=prompt, sampling_params={"max_tokens": 5}), "= 130 exceeds")


def test_stability_info_and_provenance_spans_are_accepted(http: httpx.Client, ids: dict[str, str]) -> None:
    """SDK 0.27+ `record_stability_info` and 0.26+ provenance spans (cookbook stable_reinforce) are not errors."""
    reply = _sample(http, ids, seq_id=77, record_stability_info=True)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["sample_sequence_ids"]) == 1
    request = pb.ForwardBackwardRequest()
    request.ParseFromString(proto_body(ids["model"], 78, [1, 2, 3]))
    sequence_id = reply.json()["sample_sequence_ids"][0]
    datum = request.data[0]
    datum.model_input_spans.add().prompt_tokens.CopyFrom(pb.PromptProvenanceSpan(sequence_id=sequence_id, length=3))
    datum.loss_fn_input_spans.add().sampled_tokens.CopyFrom(pb.SampledProvenanceSpan(sequence_id=sequence_id, length=3))
    reply = _fb(http, request.SerializeToString())
    assert reply.status_code == 200, reply.text


def test_sdk_surfaces_validation_message(server: Server) -> None:
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service:
        training = service.create_lora_training_client(base_model=MODEL.base_model, rank=4, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": np.array([1, 2]), "weights": np.ones(2, dtype=np.float32)},
        )
        with pytest.raises(tinker.BadRequestError, match="has length 2 but model_input has 3 tokens"):
            training.forward_backward([datum], "cross_entropy").result()
