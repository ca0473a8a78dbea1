"""Qwen3 MoE: torchtitan ``models/qwen3`` with MoE layers <-> HF ``Qwen3MoeForCausalLM``.

torchtitan stacks each layer's experts ([E, F, D] for w1/w3, [E, D, F] for w2, the HF
orientation); HF keeps one tensor per expert. torchtitan's load-balancing buffers have no
HF counterpart and are left out (HF Qwen3-MoE routes without a bias).
"""

from inspector.exporting.hf import decoder, transforms
from inspector.exporting.hf.base import EXPERTS, Architecture, Fill, Rule
from inspector.exporting.hf.config import Field, attention, sparse_layers
from inspector.exporting.hf.decoder import layer
from inspector.exporting.hf.qwen3 import HEAD_DIM, QK_NORM

EXPERT = "mlp.experts.{expert}."
INNER = "moe.routed_experts.inner_experts."
GATE = "model.layers.{layer}.mlp.gate.weight"
NUM_EXPERTS = Field(
    "num_experts",
    "routed experts per MoE layer",
    count=(decoder.HF_LAYER + EXPERT + "gate_proj.weight", "expert"),
    aliases=("num_local_experts",),
)
BIAS_NOTE = (
    "torchtitan load-balancing state: HF Qwen3-MoE picks experts without a bias, so a nonzero "
    "one routes differently there (torchtitan's own to_hf drops it too)"
)

ARCH = Architecture(
    name="qwen3_moe",
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    rules=(
        *decoder.attention(rope_permute=False),
        *decoder.QK_NORM,
        *decoder.DENSE_MLP,
        layer(EXPERT + "gate_proj.weight", INNER + "w1_EFD", EXPERTS),
        layer(EXPERT + "up_proj.weight", INNER + "w3_EFD", EXPERTS),
        layer(EXPERT + "down_proj.weight", INNER + "w2_EDF", EXPERTS),
        layer("mlp.gate.weight", "moe.router.gate.weight"),
        Rule(None, "layers.{layer}.moe.expert_bias_E", note=BIAS_NOTE),
        Rule(None, "layers.{layer}.moe.tokens_per_expert_E", note=BIAS_NOTE),
        *decoder.NORMS_AND_ENDS,
    ),
    fields=(
        *decoder.FIELDS,
        HEAD_DIM,
        NUM_EXPERTS,
        Field(
            "moe_intermediate_size",
            "expert MLP width",
            shape=(decoder.HF_LAYER + EXPERT + "gate_proj.weight", 0),
        ),
        Field("num_experts_per_tok", "experts each token is routed to (top-k)", required=True),
        Field(
            "norm_topk_prob",
            "renormalise the top-k router weights",
            advice="transformers will use its default (false)",
        ),
    ),
    checks=(
        attention(lambda hidden, heads: hidden // heads, rope_pairs=False),
        sparse_layers(decoder.HF_LAYER + EXPERT + "gate_proj.weight", NUM_EXPERTS),
    ),
    markers=(QK_NORM, GATE),
    # torchtitan's MoE registers expert_bias (persistent) when load balancing is on, its
    # default: DCP's strict loader needs the key. Zeros route exactly as HF's no bias does.
    fills=(
        Fill(
            "layers.{layer}.moe.expert_bias_E",
            GATE,
            transforms.zeros_per_row,
            "float32",
            "torchtitan's initial load-balancing bias (zeros), which routes as HF does",
        ),
    ),
)
