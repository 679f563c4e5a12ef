"""Several PEFT adapters served from slots of one model: parity with PEFT, row independence, export, meshes.

Each family's model is loaded once per module with three adapter slots, and two real `peft` adapters of
different ranks and targets are written into slots 1 and 2; one jitted forward per model (fixed batch
shape) serves every test, so compiles stay few.
"""

import warnings

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

# The tiny-PEFT helpers live next door; pytest puts this folder on sys.path (tests/ has no __init__.py).
from test_peft import ATTN_MLP, load_base, make_peft  # noqa: E402

from tx.lora.adapters import adapter_targets, read_slot, write_slot  # noqa: E402
from tx.lora.layers import LoRASpec  # noqa: E402
from tx.lora.merge import merge_to_hf  # noqa: E402
from tx.lora.params import AdapterRoles, LoRAParam, LoRARows  # noqa: E402
from tx.lora.peft import AdapterConfig, load_peft, save_peft  # noqa: E402
from tx.lora.targets import SOFTMAX_ATTN, UNEMBED  # noqa: E402

QWEN3_TARGETS = (*SOFTMAX_ATTN, "gate_proj", "up_proj", "down_proj", *UNEMBED)  # what a Qwen3 model adapts
from tx.lora.select import select, take_adapters  # noqa: E402
from tx.lora.slots import SlotTable  # noqa: E402
from tx.models.sharding import make_mesh  # noqa: E402
from tx.models.weights import load_model  # noqa: E402

pytestmark = pytest.mark.parity

SPEC = LoRASpec(slots=4, max_rank=8)
# Adapter 1: rank 4 on every module incl. lm_head; adapter 2: full stacked rank, rsLoRA, attention q/v only.
ADAPTERS = {
    "one": dict(r=4, lora_alpha=8, target_modules=ATTN_MLP + ["lm_head"]),
    "two": dict(r=8, lora_alpha=12, target_modules=["q_proj", "v_proj"], use_rslora=True),
}
TOKENS = np.random.RandomState(7).randint(0, 256, (4, 10)).astype(np.int32)
FAMILIES = {"qwen3-tied": ("qwen3", True), "llama-untied": ("llama", False)}


class Served:
    """A loaded model with adapters in slots, its slot table, the PEFT reference logits and one jitted forward."""

    def __init__(self, path, spec: LoRASpec, mesh=None) -> None:
        self.path = path
        self.model, self.cfg = load_model(str(path), lora=spec, mesh=mesh, progress=False)
        self.table = SlotTable(spec.slots - 1, spec.max_rank)
        graphdef = nnx.graphdef(self.model)
        self.forward = jax.jit(lambda state, tokens, rows: nnx.merge(graphdef, state)(tokens, rows=rows)[0])

    def write(self, owner: str, config: AdapterConfig, weights) -> int:
        info = self.table.allocate(
            owner, "run", config.rank, config.alpha, frozenset(config.target_modules), config.use_rslora
        )
        nnx.update(self.model, write_slot(nnx.state(self.model, LoRAParam), info.slot, config, weights))
        return info.slot

    def logits(self, slots) -> np.ndarray:
        rows = LoRARows(np.asarray(slots, np.int32), self.table.scale_table())
        return np.asarray(self.forward(nnx.state(self.model), TOKENS, rows))


def peft_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, hf_models, tmp_path_factory):
    family, tied = FAMILIES[request.param]
    path, _ = hf_models(family, 2, tied)
    served = Served(path, SPEC)
    served.adapters = {}
    for name, kwargs in ADAPTERS.items():
        directory = tmp_path_factory.mktemp(f"{request.param}-{name}")
        model = make_peft(path, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(directory)
        config, weights = load_peft(directory)
        served.adapters[name] = (served.write(name, config, weights), config, peft_logits(model))
    return served


def test_slot_logits_match_peft(served):
    for slot, _, expected in served.adapters.values():
        np.testing.assert_allclose(served.logits([slot] * 4), expected, atol=1e-4, rtol=0)


def test_mixed_batch_rows_equal_each_row_alone(served):
    one, two = served.adapters["one"][0], served.adapters["two"][0]
    mixed = [one, 0, two, 0]
    got = served.logits(mixed)
    # Slot-0 rows are exactly the base rows of the same program, whatever their neighbours' adapters.
    np.testing.assert_array_equal(got[[1, 3]], served.logits([0] * 4)[[1, 3]])
    base, _ = served.model(TOKENS)  # eager, without LoRARows at all: another program, so rounding may differ
    np.testing.assert_allclose(got[[1, 3]], np.asarray(base)[[1, 3]], atol=1e-6, rtol=0)
    for r, slot in enumerate(mixed):
        np.testing.assert_allclose(got[r], served.logits([slot] * 4)[r], atol=1e-5, rtol=0)


def test_selected_slots_equal_the_full_stack(served):
    """What the engine runs: the stack cut to the slots a batch uses (G=1, G=2, none) gives the same logits."""
    one, two = served.adapters["one"][0], served.adapters["two"][0]
    state = nnx.state(served.model)
    for slots in ([one] * 4, [one, 0, two, 0], [0] * 4):
        sel = select(slots, served.table.scale_table())
        if sel is None:
            got = served.forward(state, TOKENS, None)
        else:
            flat = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
            cut = nnx.from_flat_state(list(take_adapters(flat, sel, AdapterRoles.of(state)).items()))
            got = served.forward(cut, TOKENS, sel.rows)
        np.testing.assert_allclose(np.asarray(got), served.logits(slots), atol=1e-5, rtol=0)


def test_read_slot_exports_to_peft_and_merge(served, tmp_path):
    slot, config, expected = served.adapters["one"]
    info = served.table.owner_of(slot)
    weights = read_slot(nnx.state(served.model, LoRAParam), slot, info.rank, info.targets)
    assert len(weights) == 7 * served.cfg.num_layers + 1
    assert adapter_targets(nnx.state(served.model, LoRAParam)) == frozenset(QWEN3_TARGETS)
    targets = tuple(t for t in QWEN3_TARGETS if t in info.targets)
    exported = AdapterConfig(info.rank, info.alpha, targets, str(served.path), info.use_rslora)
    save_peft(tmp_path / "adapter", exported, weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = peft.PeftModel.from_pretrained(load_base(served.path), tmp_path / "adapter").eval()
    ours = served.logits([slot] * 4)
    np.testing.assert_allclose(peft_logits(reloaded), ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(peft_logits(reloaded), expected, atol=1e-5, rtol=0)
    merge_to_hf(served.path, tmp_path / "merged", exported, weights)
    np.testing.assert_allclose(peft_logits(load_base(tmp_path / "merged")), ours, atol=1e-4, rtol=0)


def test_unused_targets_are_zero_after_write(served):
    slot, _, _ = served.adapters["two"]
    weights = read_slot(nnx.state(served.model, LoRAParam), slot, SPEC.max_rank, frozenset(QWEN3_TARGETS))
    for name, (a, b) in weights.items():
        live = name.rsplit(".", 1)[-1] in ("q_proj", "v_proj")
        assert bool(np.any(a)) == live and bool(np.any(b)) == live, name


@pytest.mark.parametrize("kernel,mesh", [("gather", (2, 2, 2)), ("grouped", (1, 2, 4))])
def test_mesh_and_kernel_forms_match_single_device(served, kernel, mesh):
    if served.cfg.family != "qwen3":
        pytest.skip("one family is enough for the sharded check")
    if len(jax.devices()) < 8:  # one accelerator (the device check); the CPU test session simulates 8
        pytest.skip(f"the mesh needs 8 devices, {len(jax.devices())} here")
    sharded = Served(served.path, LoRASpec(SPEC.slots, SPEC.max_rank, kernel), make_mesh(*mesh))
    before = {p: v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(sharded.model, LoRAParam))}
    lora = nnx.state(served.model, LoRAParam)
    for name, (slot, config, _) in served.adapters.items():
        weights = read_slot(lora, slot, config.rank, frozenset(config.target_modules))
        assert sharded.write(name, config, weights) == slot
    after = {p: v.get_value().sharding for p, v in nnx.to_flat_state(nnx.state(sharded.model, LoRAParam))}
    assert after == before and any(len(s.device_set) == 8 for s in after.values())
    mixed = [served.adapters["one"][0], 0, served.adapters["two"][0], served.adapters["one"][0]]
    np.testing.assert_allclose(sharded.logits(mixed), served.logits(mixed), atol=1e-5, rtol=0)
