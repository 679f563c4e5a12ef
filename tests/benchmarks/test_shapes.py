"""The benchmark shapes' FLOP count: a MoE shape's active weights are the dense shape's of the same width
plus its routers, each routed expert counted at top_k / experts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from shapes import SHAPES, active_param_count, model_config  # noqa: E402


def test_moe_shapes_count_their_active_weights() -> None:
    dense = active_param_count(model_config("small"))
    moe = SHAPES["qwen3-moe-small"]
    routers = moe["num_hidden_layers"] * moe["num_experts"] * moe["hidden_size"]
    assert active_param_count(model_config("qwen3-moe-small")) == dense + routers
    assert active_param_count(model_config("gpt-oss-small")) > dense + routers  # biases and sinks besides


def test_the_hybrid_moe_shape_parses_as_qwen3_5_moe_with_a_shared_expert() -> None:
    cfg = model_config("qwen3.5-moe-small")
    assert cfg.family == "qwen3_5_moe" and cfg.moe is not None and cfg.moe.shared_expert_size == 768
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
