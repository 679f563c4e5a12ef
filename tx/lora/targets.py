"""The short module names an adapter can target, grouped as the SDK's `train_attn / train_mlp /
train_unembed` flags choose them. A family adapts the names its layers have; the others are absent.

"Attention" is every token mixer's projections: softmax attention's q/k/v/o and, in Qwen3.5's Gated
DeltaNet layers, the fused q/k/v input, the output gate (z), the decay (a) and write-strength (b)
inputs, and the output projection.
"""

SOFTMAX_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")  # gate_up_proj: gpt-oss's fused experts
UNEMBED = ("lm_head",)
ALL = (*SOFTMAX_ATTN, *DELTANET, *MLP, *UNEMBED)  # PEFT files may name any of these

ATTN_TARGETS = frozenset((*SOFTMAX_ATTN, *DELTANET))
MLP_TARGETS = frozenset(MLP)
UNEMBED_TARGETS = frozenset(UNEMBED)
ALL_TARGETS = frozenset(ALL)
