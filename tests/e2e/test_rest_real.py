"""The REST routes over checkpoints the real engine wrote: listing, delete, TTL, publish, archive download,
copy_weights and save_weights_external, on SQLite and (when configured) Postgres records.

One trained LoRA run per backend; every checkpoint it saves holds real files, so sizes, downloads and
copies are checked against what the engine wrote and what `peft` or a resumed run reads back.
"""

import copy
import io
import tarfile
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pytest
import tinker
from peft import PeftModel
from tinker import types

from e2e.conftest import KEY
from e2e.test_peft_export import peft_logprobs
from e2e.test_sdk_loops import sl_batch
from tx.api.paths import checkpoint_dir, parse_tinker_path
from tx.api.routes_rest import sweep_expired_checkpoints
from tx.db import open_database, owner_of
from tx.db.tables import utcnow

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def trained(live):
    """(training client, its batch, its forward logprobs) after two steps, and the REST client. In a session
    of its own, ended with the module: the shared server's adapter slots are few, and other modules need them."""
    with tinker.ServiceClient(base_url=live.url, api_key=KEY) as service:
        client = service.create_lora_training_client(base_model=live.base_model, rank=4, seed=0).result()
        batch = sl_batch(21)
        for _ in range(2):
            client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        outputs = client.forward(batch, "cross_entropy").result().loss_fn_outputs
        logprobs = [o["logprobs"].to_numpy() for o in outputs]
        yield client, batch, logprobs, tinker.RestClient(base_url=live.url, api_key=KEY)


def directory_of(live, path: str):
    parsed = parse_tinker_path(path)
    assert parsed is not None
    return checkpoint_dir(live.data_dir, parsed)


def disk_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def assert_adapter_matches(live, directory, batch, logprobs) -> None:
    model = PeftModel.from_pretrained(copy.deepcopy(live.torch_model), str(directory)).eval()
    for datum, want in zip(batch, logprobs, strict=True):
        np.testing.assert_allclose(peft_logprobs(model, datum), want, atol=1e-4)


def test_listing_reports_what_the_engine_wrote_and_delete_removes_it(live, trained):
    client, _, _, rest = trained
    path = client.save_state("rest-listed").result().path
    directory = directory_of(live, path)
    [row] = [c for c in rest.list_checkpoints(client.model_id).result().checkpoints if c.tinker_path == path]
    assert row.checkpoint_type == "training" and row.size_bytes == disk_bytes(directory) > 10_000
    assert path in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    run = rest.get_training_run(client.model_id).result()
    assert run.lora_rank == 4 and run.base_model == live.base_model
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.is_lora and info.lora_rank == 4

    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert not directory.exists()
    with pytest.raises(tinker.TinkerError):
        client.load_state(path).result()


def test_ttl_and_publish_round_trip(trained):
    client, _, _, rest = trained
    path = client.save_state("rest-ttl", ttl_seconds=7200).result().path

    def row():
        return next(c for c in rest.list_checkpoints(client.model_id).result().checkpoints if c.tinker_path == path)

    def hours_left() -> float:
        expires = row().expires_at
        assert expires is not None
        return (expires - datetime.now(UTC)).total_seconds() / 3600

    assert 1.9 < hours_left() <= 2.0 and row().public is False
    rest.set_checkpoint_ttl_from_tinker_path(path, 36_000).result()
    assert 9.9 < hours_left() <= 10.0
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert row().expires_at is None
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert row().public is True
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert row().public is False


def _expire(db, path: str) -> None:
    parsed = parse_tinker_path(path)
    assert parsed is not None
    row = db.records.get_checkpoint(parsed.run_id, parsed.checkpoint_id, owner_of(KEY))
    assert row is not None
    db.records.update_checkpoint(row, expires_at=utcnow() - timedelta(seconds=1))


def test_an_expired_checkpoint_is_gone_its_name_free_and_the_sweep_removes_its_files(live, trained):
    """A ttl means the checkpoint stops existing: not listed, not loadable, its name reusable without
    overwrite, and its files removed by the server's sweep (which every API server runs with its reaper)."""
    client, _, _, rest = trained
    path = client.save_state("rest-expiring", ttl_seconds=3600).result().path
    directory = directory_of(live, path)
    db = open_database(live.database_url, live.data_dir)
    try:
        _expire(db, path)  # as if the hour had passed
        assert path not in {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
        with pytest.raises(tinker.TinkerError, match="unknown checkpoint"):
            rest.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.TinkerError):
            client.load_state(path).result()
        assert client.save_state("rest-expiring").result().path == path  # the name is free again
        [row] = [c for c in rest.list_checkpoints(client.model_id).result().checkpoints if c.tinker_path == path]
        assert row.expires_at is None and row.size_bytes == disk_bytes(directory) > 10_000
        client.load_state(path).result()
        assert sweep_expired_checkpoints(db.records, live.data_dir) == 0 and directory.is_dir()
        _expire(db, path)
        assert sweep_expired_checkpoints(db.records, live.data_dir) == 1
        assert not directory.exists() and sweep_expired_checkpoints(db.records, live.data_dir) == 0
    finally:
        db.close()


def test_a_sampler_name_saved_again_holds_the_newest_weights(live, trained):
    """A loop that saves "latest" every evaluation: each save replaces the last (it was a 500 from the
    second on, and the first checkpoint was unlisted), and a sampler made from the name samples. The shared
    run trains one step here and is put back as it was (the later tests compare against its weights)."""
    client, batch, logprobs, rest = trained
    before = client.save_state("rest-before-latest").result().path
    try:
        first = client.save_weights_for_sampler("rest-latest").result().path
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        second = client.save_weights_for_sampler("rest-latest").result().path
        assert first == second
        listed = [c for c in rest.list_checkpoints(client.model_id).result().checkpoints if c.tinker_path == first]
        assert len(listed) == 1 and listed[0].size_bytes == disk_bytes(directory_of(live, first)) > 10_000
        now = [o["logprobs"].to_numpy() for o in client.forward(batch, "cross_entropy").result().loss_fn_outputs]
        assert_adapter_matches(live, directory_of(live, first), batch, now)
        sampler = client.create_sampling_client(first)
        prompt = types.ModelInput.from_ints([1, 2, 3])
        out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0)).result()
        assert len(out.sequences[0].tokens) == 2
    finally:
        client.load_state_with_optimizer(before).result()
    restored = [o["logprobs"].to_numpy() for o in client.forward(batch, "cross_entropy").result().loss_fn_outputs]
    for got, want in zip(restored, logprobs, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_archive_of_a_sampler_checkpoint_is_the_trained_adapter(live, trained, tmp_path):
    client, batch, logprobs, _ = trained
    path = client.save_weights_for_sampler("rest-archive").result().path
    parsed = parse_tinker_path(path)
    assert parsed is not None
    with httpx.Client(base_url=live.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30) as http:
        reply = http.get(f"/training_runs/{parsed.run_id}/checkpoints/{parsed.checkpoint_id}/archive")
        assert reply.status_code == 302, reply.text
        tar = httpx.get(reply.headers["location"], timeout=30)
    assert tar.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
        assert sorted(archive.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        archive.extractall(tmp_path, filter="data")
    assert_adapter_matches(live, tmp_path, batch, logprobs)


def test_copy_weights_of_a_trained_state_resumes_with_its_weights(live, trained):
    client, batch, logprobs, rest = trained
    source = client.save_state("rest-copy-src").result().path
    copied = rest.copy_weights(source, "proj").result()
    assert copied != source
    src_dir, dest_dir = directory_of(live, source), directory_of(live, copied)
    files = sorted(p.relative_to(src_dir).as_posix() for p in src_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(dest_dir).as_posix() for p in dest_dir.rglob("*") if p.is_file())
    [row] = rest.list_checkpoints(copied.removeprefix("tinker://").split("/")[0]).result().checkpoints
    assert row.size_bytes == disk_bytes(dest_dir)
    with tinker.ServiceClient(base_url=live.url, api_key=KEY) as service:
        resumed = service.create_training_client_from_state(copied).result()
        outputs = resumed.forward(batch, "cross_entropy").result().loss_fn_outputs
    for out, want in zip(outputs, logprobs, strict=True):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), want, atol=1e-5)


def test_save_weights_external_downloads_the_trained_adapter(live, trained, tmp_path):
    client, batch, logprobs, rest = trained
    path = client.save_weights_external("rest-external", ttl_seconds=3600).result().path
    urls = rest.get_external_weights_urls(path).result().urls
    assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
    for name, url in urls.items():  # unauthenticated, like `tinker checkpoint download`
        reply = httpx.get(url, timeout=30)
        assert reply.status_code == 200
        (tmp_path / name).write_bytes(reply.content)
    assert_adapter_matches(live, tmp_path, batch, logprobs)
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result()
    assert not directory_of(live, path).exists()


def test_a_nul_character_in_an_id_is_a_client_error(live):
    """Postgres stores no NUL in text: a model_id, session id or run id holding one made the database raise
    a DataError, a 500 the SDK retries; it is the caller's input, a 4xx on either backend."""
    with httpx.Client(base_url=live.url + "/api/v1", headers={"X-API-Key": KEY}, timeout=30) as http:
        replies = [
            http.post("/get_info", json={"model_id": "run\u0000x"}),
            http.get("/sessions/s%00x"),
            http.get("/training_runs/r%00x"),
        ]
    assert all(400 <= r.status_code < 500 for r in replies), [(r.status_code, r.text) for r in replies]
