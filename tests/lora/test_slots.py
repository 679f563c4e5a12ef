"""The host-side slot table, and the slot operations of `tx.lora.adapters` on a small stacked LoRA module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tx.engine.train_step import clear_slot_params, flat
from tx.lora.adapters import copy_slot, init_slot, read_slot, seed_key, write_slot
from tx.lora.layers import LoRALinear, LoRASpec, lora_pair
from tx.lora.params import LoRAA, LoRAParam
from tx.lora.peft import AdapterConfig
from tx.lora.slots import ALL_TARGETS, DEFAULT_ALPHA, SlotInfo, SlotsExhausted, SlotTable, targets_from_flags
from tx.models.sharding import make_mesh, state_shardings

# ------------------------------------------------------------------------------------------ slot table


def test_allocate_lowest_free_slot_and_reuse_after_free():
    table = SlotTable(max_adapters=3, max_rank=8)
    assert table.slots == 4
    assert [table.allocate(o, "run", 4).slot for o in ("a", "b", "c")] == [1, 2, 3]
    assert table.free("b").slot == 2 and "b" not in table
    assert table.allocate("d", "sampler", 2).slot == 2
    assert table.lookup("d").kind == "sampler" and table.owner_of(3).owner == "c"
    assert [info.slot for info in table] == [1, 2, 3]
    with pytest.raises(KeyError, match="'b' holds no LoRA slot"):
        table.lookup("b")
    with pytest.raises(ValueError, match="already holds LoRA slot 1"):
        table.allocate("a", "run", 4)


def test_exhaustion_names_the_flag():
    table = SlotTable(max_adapters=3, max_rank=8)
    table.allocate("run-1", "run", 4)
    table.allocate("run-2", "run", 4)
    table.allocate("snap-1", "sampler", 4)
    with pytest.raises(SlotsExhausted) as err:
        table.allocate("run-3", "run", 4)
    assert str(err.value) == (
        "all 3 LoRA slots are in use (2 runs, 1 sampler snapshots); "
        "restart with --max-lora-adapters 6 to raise the limit"
    )


def test_rank_and_target_limits():
    table = SlotTable(max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match="LoRA rank 16 is above .* restart with --max-lora-rank 16"):
        table.allocate("a", "run", 16)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        table.allocate("a", "run", 0)
    with pytest.raises(ValueError, match="non-empty subset"):
        table.allocate("a", "run", 4, targets=frozenset({"embed_tokens"}))
    assert len(table) == 0
    assert table.allocate("one", "run", 1).rank == 1 and table.allocate("top", "run", 8).rank == 8  # both edges


def test_table_bounds_and_slot_info_defaults():
    tiny = SlotTable(max_adapters=1, max_rank=1)  # the smallest table: one slot of rank 1
    assert tiny.allocate("a", "run", 1).slot == 1
    with pytest.raises(ValueError, match="--max-lora-adapters must be >= 1, got 0"):
        SlotTable(max_adapters=0, max_rank=8)
    with pytest.raises(ValueError, match="--max-lora-rank must be >= 1, got 0"):
        SlotTable(max_adapters=2, max_rank=0)
    info = tiny.lookup("a")
    assert info.scaling == DEFAULT_ALPHA / 1 and not info.use_rslora  # plain LoRA unless asked: alpha / rank
    assert SlotInfo(1, "o", "run", 4, alpha=8.0).scaling == 2.0
    assert SlotInfo(1, "o", "run", 4, alpha=8.0, use_rslora=True).scaling == 4.0
    with pytest.raises(AttributeError):
        info.rank = 2  # type: ignore[misc]  # a record of the allocation, never edited in place


def test_targets_from_flags():
    softmax, deltanet = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"}
    assert targets_from_flags(True, False, False) == softmax | deltanet | {"out_proj"}
    mlp = {"gate_proj", "up_proj", "gate_up_proj", "down_proj"}  # gate_up_proj: gpt-oss's fused experts
    assert targets_from_flags(False, True, True) == mlp | {"lm_head"}
    assert targets_from_flags(True, True, True) == ALL_TARGETS
    with pytest.raises(ValueError, match="at least one"):
        targets_from_flags(False, False, False)


def test_scale_table_masks_rank_and_keeps_slot_zero_empty():
    table = SlotTable(max_adapters=3, max_rank=8)
    table.allocate("a", "run", 4)
    table.allocate("b", "run", 8, alpha=16, use_rslora=True)
    scale = table.scale_table()
    assert scale.shape == (4, 8) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale[0], 0)
    np.testing.assert_allclose(scale[1], [DEFAULT_ALPHA / 4] * 4 + [0] * 4)
    np.testing.assert_allclose(scale[2], 16 / np.sqrt(8))
    np.testing.assert_array_equal(scale[3], 0)


def test_lru_victim_is_least_recently_used_sampler():
    table = SlotTable(max_adapters=4, max_rank=8)
    table.allocate("run", "run", 4)
    for owner in ("s1", "s2", "s3"):
        table.allocate(owner, "sampler", 4)
    table.touch("s1")
    assert table.eviction_victim() == "s2"
    assert table.eviction_victim(protect=frozenset({"s2"})) == "s3"
    table.touch("run")
    table.free("s2")
    table.free("s3")
    table.free("s1")
    assert table.eviction_victim() is None  # training slots are never evicted


# ------------------------------------------------------------------------------------------ slot operations

SPEC = LoRASpec(slots=4, max_rank=4)
D, F, L = 8, 16, 2


class Tiny(nnx.Module):
    """Same layout as the decoder: stacked projections under `model.layers`, an unstacked `lm_head`."""

    def __init__(self) -> None:
        self.model = nnx.Dict(layers=nnx.Dict(mlp=nnx.Dict()))
        self.model.layers.mlp.up_proj = LoRALinear(
            D, F, axes=("embed", "mlp"), dtype=jnp.float32, lora=SPEC, stack=(L,)
        )
        self.lm_head = LoRALinear(D, F, axes=("embed", "vocab"), dtype=jnp.float32, lora=SPEC)


@pytest.fixture
def lora() -> nnx.State:
    return nnx.state(Tiny(), LoRAParam)


def random_weights(rank: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    names = [f"model.layers.{i}.mlp.up_proj" for i in range(L)] + ["lm_head"]
    return {
        n: (rng.normal(size=(D, rank)).astype(np.float32), rng.normal(size=(rank, F)).astype(np.float32)) for n in names
    }


def config(rank: int, targets=("up_proj", "lm_head")) -> AdapterConfig:
    return AdapterConfig(rank=rank, alpha=8, target_modules=targets, base_model_name_or_path="tiny")


def test_write_read_round_trip_pads_and_masks(lora):
    weights = random_weights(2)
    lora = write_slot(lora, 2, config(2), weights)
    back = read_slot(lora, 2, 2, frozenset({"up_proj", "lm_head"}))
    assert back.keys() == weights.keys()
    for name, (a, b) in weights.items():
        np.testing.assert_array_equal(back[name][0], a)
        np.testing.assert_array_equal(back[name][1], b)
    padded = read_slot(lora, 2, 4, frozenset({"lm_head"}))
    assert list(padded) == ["lm_head"] and not padded["lm_head"][0][:, 2:].any()
    others = np.asarray(lora["model"]["layers"]["mlp"]["up_proj"]["lora_a"][...])
    assert not others[:, [0, 1, 3]].any()


def test_write_zeroes_modules_missing_from_weights(lora):
    lora = write_slot(lora, 1, config(2), random_weights(2))
    only_head = {"lm_head": random_weights(2, seed=1)["lm_head"]}
    lora = write_slot(lora, 1, config(2, ("lm_head",)), only_head)
    back = read_slot(lora, 1, 4, frozenset({"up_proj"}))
    assert not any(a.any() or b.any() for a, b in back.values())


def test_write_errors(lora):
    with pytest.raises(ValueError, match="--max-lora-rank 8"):
        write_slot(lora, 1, config(8), random_weights(8))
    with pytest.raises(ValueError, match="no LoRA-adapted modules"):
        write_slot(lora, 1, config(2), {"model.layers.5.mlp.up_proj": random_weights(2)["lm_head"]})
    with pytest.raises(ValueError, match="not in the adapter's target_modules"):
        write_slot(lora, 1, config(2, ("lm_head",)), random_weights(2))
    with pytest.raises(ValueError, match="do not fit"):
        write_slot(lora, 1, config(2), {"lm_head": (np.zeros((D + 1, 2)), np.zeros((2, F)))})
    with pytest.raises(ValueError, match="do not fit"):  # B with fewer rows than the rank
        write_slot(lora, 1, config(2), {"lm_head": (np.zeros((D, 2)), np.zeros((1, F)))})
    with pytest.raises(ValueError, match="slot 0 is the base model"):
        write_slot(lora, 0, config(2), random_weights(2))


def clear_slot(lora: nnx.State, slot: int) -> nnx.State:
    cleared = clear_slot_params(flat(lora), jnp.int32(slot))
    return nnx.from_flat_state(
        [(path, var.replace(cleared[tuple(str(k) for k in path)])) for path, var in nnx.to_flat_state(lora)]
    )


def test_copy_and_clear(lora):
    lora = write_slot(lora, 1, config(3), random_weights(3))
    lora = copy_slot(lora, 1, 3)
    targets = frozenset({"up_proj", "lm_head"})
    copied = read_slot(lora, 3, 4, targets)
    for name, (a, b) in read_slot(lora, 1, 4, targets).items():
        np.testing.assert_array_equal(copied[name][0], a)
        np.testing.assert_array_equal(copied[name][1], b)
    lora = clear_slot(lora, 1)  # the bank's one program over every stacked adapter
    assert not any(a.any() or b.any() for a, b in read_slot(lora, 1, 4, targets).values())
    assert any(a.any() for a, _ in read_slot(lora, 3, 4, targets).values())


def test_every_bit_of_a_64_bit_seed_counts() -> None:
    """`jax.random.key` keeps a seed's low 32 bits: 2**32 initialised what 0 did, -1 what 2**32 - 1 did.
    Seeds below 2**32 keep the key they always had."""
    up = "model.layers.0.mlp.up_proj"

    def first_a(seed: int) -> np.ndarray:
        fresh = nnx.state(Tiny(), LoRAParam)  # init_slot donates the stacks it writes
        return read_slot(init_slot(fresh, 1, 3, frozenset({"up_proj"}), seed=seed), 1, 4, ALL_TARGETS)[up][0]

    for a, b in ((0, 2**32), (2**32 - 1, -1), (7, 7 + 2**40)):
        assert not np.array_equal(first_a(a), first_a(b)), (a, b)
    np.testing.assert_array_equal(jax.random.key_data(seed_key(12345)), jax.random.key_data(jax.random.key(12345)))


def test_init_is_peft_like_and_deterministic(lora):
    first = read_slot(init_slot(lora, 1, 3, frozenset({"up_proj"}), seed=5), 1, 4, ALL_TARGETS)
    again = read_slot(
        init_slot(nnx.state(Tiny(), LoRAParam), 2, 3, frozenset({"up_proj", "lm_head"}), 5), 2, 4, ALL_TARGETS
    )
    for name in ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"):
        a, b = first[name]
        np.testing.assert_array_equal(a, again[name][0])
        assert not b.any() and not a[:, 3:].any() and np.abs(a[:, :3]).max() <= 1 / np.sqrt(D)
        assert np.all(a[:, :3] != 0)
    assert not first["lm_head"][0].any() and again["lm_head"][0].any()
    assert not np.array_equal(first["model.layers.0.mlp.up_proj"][0], first["model.layers.1.mlp.up_proj"][0])


def test_writes_keep_sharding():
    mesh = make_mesh(1, 2, 4)
    graphdef, state = nnx.split(nnx.eval_shape(Tiny))
    shardings = dict(nnx.to_flat_state(state_shardings(state, mesh)))
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(jnp.zeros(var.shape, var.dtype), shardings[path]))
    model = nnx.merge(graphdef, state)
    lora = nnx.state(model, LoRAParam)
    before = {p: v.get_value().sharding for p, v in nnx.to_flat_state(lora)}
    lora = init_slot(write_slot(lora, 1, config(2), random_weights(2)), 2, 2, ALL_TARGETS, seed=0)
    lora = copy_slot(lora, 1, 3)
    after = {p: v.get_value().sharding for p, v in nnx.to_flat_state(lora)}
    assert after == before and len(after[("lm_head", "lora_b")].device_set) == 8
    np.testing.assert_array_equal(read_slot(lora, 3, 2, ALL_TARGETS)["lm_head"][1], random_weights(2)["lm_head"][1])
    for path, var in nnx.to_flat_state(clear_slot(lora, 2)):  # the engine's program: an equivalent layout
        assert var.get_value().sharding.is_equivalent_to(before[path], var.get_value().ndim)


def test_slot_bounds_and_the_base_slot(lora):
    """Slot 0 (the base model) reads as zeros and is never written; no slot past the stack is touched
    (a dynamic index there would clamp into the last slot); the stacks are donated, not copied."""
    targets = frozenset({"up_proj", "lm_head"})
    lora = write_slot(lora, 1, config(2), random_weights(2))
    assert not any(a.any() or b.any() for a, b in read_slot(lora, 0, 4, targets).values())
    lora = copy_slot(lora, 0, 1)  # the base model's empty adapter, copied
    assert not any(a.any() or b.any() for a, b in read_slot(lora, 1, 4, targets).values())
    S = SPEC.slots
    for attempt in (
        lambda: init_slot(lora, 0, 2, targets, seed=0),
        lambda: init_slot(lora, S, 2, targets, seed=0),
        lambda: copy_slot(lora, 1, 0),
        lambda: copy_slot(lora, S, 1),
        lambda: read_slot(lora, S, 2, targets),
    ):
        with pytest.raises(ValueError, match="out of range"):
            attempt()
    stacked = lora["lm_head"]["lora_a"][...]
    lora = init_slot(lora, 2, 2, targets, seed=0)
    assert stacked.is_deleted() and not lora["lm_head"]["lora_a"][...].is_deleted()


def test_states_without_adapters_or_their_axes_are_refused():
    with pytest.raises(ValueError, match="adapter rank 1 is above the 0"):
        init_slot(nnx.State({}), 1, 1, frozenset({"lm_head"}), seed=0)
    a, b = lora_pair(D, F, ("embed", "vocab"), SPEC, ())
    unnamed = LoRAA(a.get_value(), logical_axes=("adapter", "embed", None))
    state = nnx.State({"lm_head": {"lora_a": unnamed, "lora_b": b}})
    with pytest.raises(ValueError, match="lacks logical_axes naming its 'adapter' and 'lora_rank' axes"):
        init_slot(state, 1, 1, frozenset({"lm_head"}), seed=0)


def test_retire_frees_the_name_and_keeps_the_slot() -> None:
    table = SlotTable(max_adapters=3, max_rank=8)
    old = table.allocate("snap", "sampler", 4)
    table.allocate("run", "run", 4)
    retired = table.retire("snap")
    assert "snap" not in table and table.lookup(retired).slot == old.slot and table.lookup(retired).kind == "retired"
    assert table.allocate("snap", "sampler", 8).slot not in (old.slot, table.lookup("run").slot)
    assert table.eviction_victim(kinds=frozenset({"retired", "sampler"})) == retired  # used least recently
    assert table.scale_table()[old.slot, :4].tolist() == [old.scaling] * 4  # its rows still read it
