"""Checks that mean something only on an accelerator (`-m device`; skipped on CPU): the server as
`build_runner` assembles it there takes the plain tuning, bfloat16 for `--dtype auto`, and holds the base
weights once (the sampler reads the trainer's own buffers)."""

import jax
import pytest

from tx.engine import AdapterConfig, EngineConfig, build_runner
from tx.engine.sampler import SamplerConfig
from tx.tuning import for_backend

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def served(hf_models, tmp_path_factory):
    if jax.default_backend() == "cpu":
        pytest.skip("needs an accelerator")
    model_dir, _ = hf_models()
    runner, _ = build_runner(
        EngineConfig(base_model=str(model_dir), data_dir=tmp_path_factory.mktemp("device"), dtype="auto",
            adapters=AdapterConfig(2, 8), sampler=SamplerConfig(max_rows=4, max_seq_len=64))
    )  # fmt: skip
    return runner


def test_accelerator_takes_the_plain_forms_in_bfloat16(served):
    tuning = for_backend()
    assert not tuning.per_layer_decode and tuning.weight_major_rows == 0
    assert {v.dtype for v in served.trainer.base.values()} == {jax.numpy.dtype(tuning.auto_dtype)}
    assert not served.sampler.cfg.layer_cache


def test_the_sampler_reads_the_trainers_buffers(served):
    state = served.sampler.get_state()
    assert all(state[path] is value for path, value in served.trainer.base.items())
