"""Choices measured on the machine at hand (`tx.tuning.tuned_for`): the weight-major decode product's row cap
is timed for the model being served, kept in the data directory, read back instead of measured again, and
built into the model the engine serves; a bad store is measured over, never trusted."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import tx.tuning
from tx.engine import AdapterConfig, EngineConfig, build_runner
from tx.engine.decode_steps import DecodeRows
from tx.engine.sampler import SamplerConfig
from tx.models.causal_lm import LayerCache
from tx.tuning import (
    CPU,
    MAX_PROBE_LAYERS,
    PROBE_BYTES,
    WEIGHT_MAJOR_CANDIDATES,
    choose_weight_major_rows,
    for_backend,
    measure_weight_major_rows,
    probe_key,
    probe_layers,
    tuned_for,
)

HIDDEN, WIDTH = 64, 128  # a tiny probe: measuring it takes a fraction of a second


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    """Each test starts with nothing measured in this process."""
    monkeypatch.setattr(tx.tuning, "_MEASURED", {})


def test_the_cap_is_the_last_batch_of_the_first_winning_run():
    assert choose_weight_major_rows({2: (2.0, 1.0), 4: (2.0, 1.0), 8: (2.0, 3.0), 16: (5.0, 1.0)}) == 4
    assert choose_weight_major_rows({4: (2.0, 1.0), 2: (2.0, 1.0)}) == 4  # in batch order, however given
    assert choose_weight_major_rows({2: (1.0, 1.0)}) == 0  # a tie is no win
    assert choose_weight_major_rows({2: (1.0, 2.0), 4: (9.0, 1.0)}) == 0
    assert choose_weight_major_rows({}) == 0


def test_the_probe_streams_its_weights_from_memory():
    """Like a decode step, a probe call reads enough distinct weights that they cannot stay in cache; a wide
    model's pair is cut to half of that, a tiny model's count is capped (its decode stays in cache anyway)."""
    small = probe_layers(512, 1536, "float32")
    assert small.width == 1536 and small.count * 2 * 512 * 1536 * 4 >= PROBE_BYTES
    wide = probe_layers(4096, 12288, "float32")
    assert 2 * 4096 * wide.width * 4 <= PROBE_BYTES // 2 and wide.count == 2
    assert probe_layers(4096, 12288, "bfloat16").width == 2 * wide.width
    assert probe_layers(HIDDEN, WIDTH, "float32").count == MAX_PROBE_LAYERS


def test_measuring_gives_a_candidate_within_the_rows():
    rows = measure_weight_major_rows(HIDDEN, WIDTH, "float32", max_rows=8, options=CPU.compiler_options())
    assert rows in (0, 2, 4, 8)
    assert measure_weight_major_rows(HIDDEN, WIDTH, "float32", max_rows=1) == 0  # no candidate fits


def test_a_measured_answer_is_kept_and_read_back(tmp_path, monkeypatch):
    store = tmp_path / "sub" / "tuning.json"
    tuned = tuned_for(CPU, HIDDEN, WIDTH, "float32", 16, store)
    key = probe_key(HIDDEN, WIDTH, "float32", 16)
    assert json.loads(store.read_text()) == {key: tuned.weight_major_rows}
    assert tuned.weight_major_rows in (0, 2, 4, 8, 16) and not tuned.measure_weight_major
    assert dataclasses.replace(tuned, weight_major_rows=CPU.weight_major_rows, measure_weight_major=True) == CPU

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although an answer was kept")

    monkeypatch.setattr(tx.tuning, "measure_weight_major_rows", no_measuring)
    other = 2 if tuned.weight_major_rows != 2 else 4
    store.write_text(json.dumps({key: other}))
    monkeypatch.setattr(tx.tuning, "_MEASURED", {})
    assert tuned_for(CPU, HIDDEN, WIDTH, "float32", 16, store).weight_major_rows == other
    store.unlink()  # the process remembers its answers too
    assert tuned_for(CPU, HIDDEN, WIDTH, "float32", 16, store).weight_major_rows == other


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", '{"KEY": 3}', '{"KEY": 4096}', '{"KEY": true}', '{"KEY": "8"}', '{"KEY": -2}'],
)
def test_a_bad_store_is_measured_over(tmp_path, content):
    """Malformed files and entries that are not candidate row counts are never used: measured and rewritten."""
    store = tmp_path / "tuning.json"
    key = probe_key(HIDDEN, WIDTH, "float32", 8)
    store.write_text(content.replace("KEY", key))
    rows = tuned_for(CPU, HIDDEN, WIDTH, "float32", 8, store).weight_major_rows
    assert rows in (0, 2, 4, 8)
    assert json.loads(store.read_text())[key] == rows


def test_an_unwritable_store_still_tunes(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    tuned = tuned_for(CPU, HIDDEN, WIDTH, "float32", 4, blocker / "tuning.json")
    assert tuned.weight_major_rows in (0, 2, 4)
    assert "could not keep the measured tuning" in caplog.text


def test_tables_without_measured_choices_pass_unchanged(tmp_path):
    gpu = for_backend("gpu")
    store = tmp_path / "tuning.json"
    assert tuned_for(gpu, HIDDEN, WIDTH, "float32", 8, store) is gpu and not store.exists()


def test_the_engine_serves_the_stored_answer(hf_models, tmp_path):
    """`build_runner` reads the data directory's answer for this model and builds it in: with a cap of 8
    the 8-row decode program multiplies weight-major ([O, 8] products), with 0 it does not."""
    model_dir, _ = hf_models()
    forms = {}
    for rows in (8, 0):
        tx.tuning._MEASURED.clear()
        data = tmp_path / f"rows{rows}"
        data.mkdir()
        cfg = json.loads((model_dir / "config.json").read_text())
        key = probe_key(cfg["hidden_size"], cfg["intermediate_size"], "float32", 8)
        (data / "tuning.json").write_text(json.dumps({key: rows}))
        runner, _ = build_runner(
            EngineConfig(base_model=str(model_dir), data_dir=data, dtype="float32",
                adapters=AdapterConfig(2, 8), sampler=SamplerConfig(max_rows=8, max_seq_len=64))
        )  # fmt: skip
        assert runner.io.tuning.weight_major_rows == rows
        forms[rows] = _decode_text(runner, 8, 64)
    out = json.loads((model_dir / "config.json").read_text())["intermediate_size"]
    assert f"f32[{out},8]" in forms[8] and f"f32[{out},8]" not in forms[0]


def _decode_text(runner, B: int, S: int) -> str:  # noqa: ANN001
    sampler = runner.sampler
    zeros = [jnp.zeros(B, jnp.int32) for _ in range(3)]
    rows = DecodeRows(*zeros, jnp.zeros(B, jnp.uint32), jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B))
    cache = LayerCache.zeros(sampler.model_cfg, B, S)
    return sampler.programs.decode.lower(sampler.get_state(), None, cache, rows).compile().as_text()


def test_candidates_are_the_decode_row_buckets():
    """The sampler's row counts are powers of two: every candidate is one (a cap between buckets means nothing)."""
    assert all(n & (n - 1) == 0 for n in WEIGHT_MAJOR_CANDIDATES)
    assert list(WEIGHT_MAJOR_CANDIDATES) == sorted(WEIGHT_MAJOR_CANDIDATES) and WEIGHT_MAJOR_CANDIDATES[0] == 2
    assert np.all(np.diff(WEIGHT_MAJOR_CANDIDATES) > 0)
