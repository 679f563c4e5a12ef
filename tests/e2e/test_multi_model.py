"""One server, one SDK session, several base models: a tiny Qwen3 and a tiny Llama 3 preloaded
(`--base-model` twice), a third tiny Qwen3 loaded on demand from an offline HF cache by its hub name.

The server is built the way `python -m tx.api` builds it (`parse_args`, `build_pool`, `build_catalog`),
in-process on a loopback port; every call goes through the unmodified tinker SDK.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
import uvicorn
from conftest import build_hf_model
from tinker import types

pytestmark = pytest.mark.e2e
KEY = "tml-multi"
HUB_NAME = "tiny-org/third-model"
SHA = "1" * 40


@dataclass
class Models:
    url: str
    qwen: tuple[str, Any]
    llama: tuple[str, Any]
    third: Any


def _publish_in_hf_cache(hub: Path, name: str) -> Any:
    """A tiny model written where the HF cache keeps `name` (refs/main -> snapshots/<sha>)."""
    root = hub / f"models--{name.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    return build_hf_model(root / "snapshots" / SHA, "qwen3", 1, False, seed=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def models(hf_models, tmp_path_factory) -> Iterator[Models]:  # type: ignore[no-untyped-def]
    import huggingface_hub.constants

    from tx.api.__main__ import build_catalog, build_pool, parse_args
    from tx.api.app import create_app
    from tx.api.context import Settings
    from tx.db import open_database
    from tx.engine.loop import Engine

    qwen_dir, qwen = hf_models("qwen3", 2, True)
    llama_dir, llama = hf_models("llama", 2, False)
    hub = tmp_path_factory.mktemp("hf-home") / "hub"
    third = _publish_in_hf_cache(hub, HUB_NAME)
    data_dir = tmp_path_factory.mktemp("multi-data")
    argv = ["--base-model", str(qwen_dir), "--base-model", str(llama_dir), "--data-dir", str(data_dir)]
    argv += ["--max-lora-rank", "8", "--max-lora-adapters", "6", "--max-seq-len", "128", "--decode-rows", "8"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
        args = parse_args([*argv, "--dtype", "float32"])
        db = open_database(None, data_dir)
        pool = build_pool(args)
        engine = Engine(db.queue, pool)
        engine.start()
        port = _free_port()
        app = create_app(Settings(data_dir=data_dir), db, build_catalog(args, pool))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        yield Models(f"http://127.0.0.1:{port}", (str(qwen_dir), qwen), (str(llama_dir), llama), third)
        server.should_exit = True
        thread.join(10)
        engine.stop()
        pool.close()
        db.close()


@pytest.fixture(scope="module")
def service(models: Models) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=models.url, api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    inputs = {"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(len(tokens) - 1, np.float32)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


BATCH = [_datum([5, 17, 42, 9, 100, 3, 77, 12]), _datum([8, 1, 250, 64, 31, 2])]
PROMPT = [11, 22, 33, 44, 55]


def _reference_logprobs(torch_model: Any, tokens: list[int]) -> np.ndarray:
    """log p(tokens[i] | tokens[:i]) for i >= 1, from transformers in float32."""
    with torch.no_grad():
        logits = torch_model(torch.tensor([tokens])).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def _assert_forward_matches(result: Any, torch_model: Any) -> None:
    for datum, out in zip(BATCH, result.loss_fn_outputs, strict=True):
        tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
        np.testing.assert_allclose(out["logprobs"].to_numpy(), _reference_logprobs(torch_model, tokens), atol=1e-4)


def _sample(sampler: tinker.SamplingClient) -> Future:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params, include_prompt_logprobs=True)


def _assert_prompt_logprobs_match(result: Any, torch_model: Any) -> None:
    np.testing.assert_allclose(result.prompt_logprobs[1:], _reference_logprobs(torch_model, PROMPT), atol=1e-4)


def test_two_families_train_and_sample_concurrently(models: Models, service: tinker.ServiceClient) -> None:
    (qwen_name, qwen), (llama_name, llama) = models.qwen, models.llama
    names = (qwen_name, llama_name)
    runs = {name: service.create_lora_training_client(base_model=name, rank=4, seed=0) for name in names}
    clients = {name: future.result() for name, future in runs.items()}
    samplers = {name: service.create_sampling_client(base_model=name).result() for name in (qwen_name, llama_name)}
    # Everything in flight at once: forward passes and base-model samples on both models.
    forwards = {name: c.forward(BATCH, "cross_entropy") for name, c in clients.items()}
    samples = {name: _sample(s) for name, s in samplers.items()}
    for name, torch_model in ((qwen_name, qwen), (llama_name, llama)):
        _assert_forward_matches(forwards[name].result(), torch_model)  # LoRA B starts at zero: the base model
        _assert_prompt_logprobs_match(samples[name].result(), torch_model)
    adam = types.AdamParams(learning_rate=1e-2)
    losses: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(4):
        steps = {name: c.forward_backward(BATCH, "cross_entropy") for name, c in clients.items()}
        for name, step in steps.items():
            losses[name].append(step.result().metrics["loss:sum"])
        for future in [c.optim_step(adam) for c in clients.values()]:
            future.result()
    assert all(values[-1] < values[0] for values in losses.values()), losses
    tuned = {name: c.save_weights_and_get_sampling_client() for name, c in clients.items()}
    for name, sampler in tuned.items():
        assert len(_sample(sampler).result().sequences) == 2, name
    info = clients[llama_name].get_info()
    assert info.model_data.model_name == llama_name and info.model_data.arch == "llama"


def test_a_hub_model_in_the_offline_cache_loads_on_demand(models: Models, service: tinker.ServiceClient) -> None:
    rest = tinker.RestClient(base_url=models.url, api_key=KEY)
    listed = {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    assert listed == {models.qwen[0], models.llama[0]}
    sampler = service.create_sampling_client(base_model=HUB_NAME).result()
    _assert_prompt_logprobs_match(_sample(sampler).result(), models.third)
    training = service.create_lora_training_client(base_model=HUB_NAME, rank=4, seed=0).result()
    _assert_forward_matches(training.forward(BATCH, "cross_entropy").result(), models.third)
    caps = rest.get_server_capabilities().result().supported_models
    expected = {models.qwen[0]: 128, models.llama[0]: 128, HUB_NAME: 128}
    assert {m.model_name: m.max_context_length for m in caps} == expected
    env = {**os.environ, "TINKER_BASE_URL": models.url, "TINKER_API_KEY": KEY}
    for _ in range(2):  # the SDK's CLI sometimes aborts (SIGABRT) in its own interpreter teardown after
        cli = subprocess.run(  # printing its whole answer (seen once in CI under two workers): one retry
            [str(Path(sys.executable).parent / "tinker"), "--format", "json", "model", "list"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if cli.returncode != -signal.SIGABRT:
            break
    assert cli.returncode == 0, cli.stderr
    assert HUB_NAME in cli.stdout and models.llama[0] in cli.stdout and models.qwen[0] in cli.stdout


def test_a_tinker_variant_name_serves_its_hub_model_at_the_context_it_names(
    models: Models, service: tinker.ServiceClient
) -> None:
    """`org/model:peft:<context>` is how Tinker names its models (tinker-cookbook's `rl_numerics_check` default,
    `Qwen/Qwen3.6-35B-A3B:peft:262144`): the hub model, its context capped. It was a 404 (no such repo)."""
    variant = f"{HUB_NAME}:peft:24"
    training = service.create_lora_training_client(base_model=variant, rank=4, seed=0).result()
    assert training.get_info().model_data.model_name == variant
    _assert_forward_matches(training.forward(BATCH, "cross_entropy").result(), models.third)
    sampler = service.create_sampling_client(base_model=variant).result()
    _assert_prompt_logprobs_match(_sample(sampler).result(), models.third)
    with pytest.raises(tinker.BadRequestError, match="24"):  # the hub model alone takes 128
        training.forward([_datum(list(range(1, 31)))], "cross_entropy").result()
    caps = tinker.RestClient(base_url=models.url, api_key=KEY).get_server_capabilities().result().supported_models
    assert [m.model_name for m in caps].count(HUB_NAME) == 1  # the variant loaded nothing more
    # The SDK's base_model override of a checkpoint: "compatible with it (e.g. a different context length)".
    saved = training.save_state("variant").result().path
    widened = service.create_training_client_from_state(saved, base_model=HUB_NAME).result()
    assert widened.get_info().model_data.model_name == HUB_NAME
    assert len(widened.forward([_datum(list(range(1, 31)))], "cross_entropy").result().loss_fn_outputs) == 1
    with pytest.raises(tinker.BadRequestError, match="was made on base model"):
        service.create_training_client_from_state(saved, base_model=models.qwen[0]).result()
    with pytest.raises(tinker.NotFoundError, match="not in the HF cache"):
        service.create_lora_training_client(base_model=f"{HUB_NAME}:full:24", rank=4).result()


def test_prompt_logprobs_of_the_last_n_prompt_tokens(models: Models, service: tinker.ServiceClient) -> None:
    """`prompt_logprobs_last_n` (SDK 0.33+): the last N prompt positions scored as without it, the ones before
    None, for the logprobs and their top-K alike. It was refused."""
    sampler = service.create_sampling_client(base_model=models.llama[0]).result()
    prompt, params = types.ModelInput.from_ints(PROMPT), types.SamplingParams(max_tokens=2, seed=3)
    full = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=2
    ).result()
    skipped = len(PROMPT) - 2
    assert last.prompt_logprobs[:skipped] == [None] * skipped and None not in last.prompt_logprobs[skipped:]
    np.testing.assert_allclose(last.prompt_logprobs[skipped:], full.prompt_logprobs[skipped:], atol=1e-5)
    assert last.topk_prompt_logprobs[:skipped] == [None] * skipped
    for ours, whole in zip(last.topk_prompt_logprobs[skipped:], full.topk_prompt_logprobs[skipped:], strict=True):
        assert [t for t, _ in ours] == [t for t, _ in whole]
        np.testing.assert_allclose([lp for _, lp in ours], [lp for _, lp in whole], atol=1e-5)


def test_unknown_and_unsupported_models_fail_clearly(service: tinker.ServiceClient, tmp_path: Path) -> None:
    with pytest.raises(tinker.NotFoundError, match="not in the HF cache"):
        service.create_lora_training_client(base_model="tiny-org/not-there", rank=4, seed=0).result()
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(tinker.BadRequestError, match="unsupported architecture.*supported: .*LlamaForCausalLM"):
        service.create_lora_training_client(base_model=str(odd), rank=4).result()


def test_checkpoints_stay_with_their_model(models: Models, service: tinker.ServiceClient) -> None:
    qwen_name, llama_name = models.qwen[0], models.llama[0]
    llama_run = service.create_lora_training_client(base_model=llama_name, rank=4, seed=0).result()
    llama_run.forward_backward(BATCH, "cross_entropy").result()
    llama_run.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = llama_run.save_state("trained").result().path
    resumed = service.create_training_client_from_state(path).result()
    assert resumed.get_info().model_data.model_name == llama_name
    want = llama_run.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    got = resumed.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-6)
    # A sampler checkpoint samples on its own base model, with its adapter: the run's own logprobs.
    sampler_path = llama_run.save_weights_for_sampler("snap").result().path
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    scored = llama_run.forward([_datum(PROMPT)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    sampled = _sample(sampler).result().prompt_logprobs[1:]
    np.testing.assert_allclose(sampled, scored.to_numpy(), atol=1e-4)
    base_logprobs = _reference_logprobs(models.llama[1], PROMPT)
    assert np.abs(np.asarray(sampled) - base_logprobs).max() > 1e-3, "the snapshot sampled without its adapter"
    qwen_run = service.create_lora_training_client(base_model=qwen_name, rank=4, seed=0).result()
    with pytest.raises(tinker.BadRequestError, match="was made on base model"):
        qwen_run.load_state(path).result()


def test_a_checkpoint_loads_into_a_run_on_another_spelling_of_its_model(models: Models, service) -> None:  # type: ignore[no-untyped-def]
    """`dir` and `dir/` name one model (the pool loads it once): a checkpoint of a run on one loads into a run
    on the other. The string compare refused it as made on another base model."""
    name = models.llama[0]
    first = service.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    first.forward_backward(BATCH, "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = first.save_state("spelled").result().path
    second = service.create_lora_training_client(base_model=name.rstrip("/") + "/", rank=4).result()
    second.load_state(path).result()
    want = first.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    got = second.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-6)
