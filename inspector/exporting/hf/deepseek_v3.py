"""DeepSeek-V3: torchtitan ``models/deepseek_v3`` <-> HF ``DeepseekV3ForCausalLM``.

Multi-head latent attention (q_proj, or q_a/q_b with a norm when q_lora_rank is set), MoE
layers after ``first_k_dense_replace`` dense ones, shared experts, and torchtitan's
``expert_bias`` as HF's ``e_score_correction_bias``. Pure renames: HF's ``rope_interleave``
reads torchtitan's interleaved RoPE rows as they are. Multi-token-prediction layers
(torchtitan 0.3 ``mtp_layers``) are not mapped.
"""

from inspector.errors import ExportError
from inspector.exporting.hf import decoder
from inspector.exporting.hf.base import EXPERTS, Architecture, Rule
from inspector.exporting.hf.config import Field, Shapes, missing, settle
from inspector.exporting.hf.decoder import HF_LAYER, layer

EXPERT = "mlp.experts.{expert}."
INNER = "moe.routed_experts.inner_experts."
KV_A = HF_LAYER + "self_attn.kv_a_proj_with_mqa.weight"
KV_B = HF_LAYER + "self_attn.kv_b_proj.weight"
Q_PROJ, Q_B = HF_LAYER + "self_attn.q_proj.weight", HF_LAYER + "self_attn.q_b_proj.weight"
EXPERT_GATE = HF_LAYER + EXPERT + "gate_proj.weight"
SHARED_GATE = HF_LAYER + "mlp.shared_experts.gate_proj.weight"


def mla(arch: str, cfg: dict, shapes: Shapes) -> None:
    """Head sizes of latent attention from the projections (needs num_attention_heads)."""
    heads = cfg.get("num_attention_heads")
    if heads is None:
        raise missing(arch, "num_attention_heads", "attention heads per layer")
    kv_a_found, kv_b_found = shapes.first(KV_A), shapes.first(KV_B)
    q_found = shapes.first(Q_PROJ) or shapes.first(Q_B)
    if kv_a_found is None or kv_b_found is None or q_found is None:
        raise ExportError(f"the {arch} export needs the latent attention projections")
    (kv_a, (kv_a_rows, _)), (kv_b, (kv_b_rows, _)) = kv_a_found, kv_b_found
    q, (q_rows, _) = q_found
    if q_rows % heads or kv_b_rows % heads:
        raise ExportError(
            f"hf_config num_attention_heads={heads} does not divide {q} ({q_rows} rows) and "
            f"{kv_b} ({kv_b_rows} rows)",
            key=q,
        )
    rope = kv_a_rows - cfg["kv_lora_rank"]
    settle(cfg, "qk_rope_head_dim", rope, f"{kv_a} rows - kv_lora_rank", kv_a)
    settle(cfg, "qk_nope_head_dim", q_rows // heads - rope, f"{q} rows / heads - rope", q)
    nope = cfg["qk_nope_head_dim"]
    settle(cfg, "v_head_dim", kv_b_rows // heads - nope, f"{kv_b} rows / heads - nope", kv_b)
    if shapes.first(Q_PROJ) and cfg.get("q_lora_rank"):
        raise ExportError(f"hf_config q_lora_rank={cfg['q_lora_rank']} but {q} is a full q_proj")
    settle(cfg, "num_key_value_heads", heads, "latent attention (one kv head per head)")


def moe_layers(arch: str, cfg: dict, shapes: Shapes) -> None:
    """MoE layers are the ones from ``first_k_dense_replace`` on; shared experts' width."""
    layers = cfg["num_hidden_layers"]
    sparse = {slots["layer"] for _, slots, _ in shapes.instances(EXPERT_GATE)}
    first = min(sparse, default=layers)
    if sparse != set(range(first, layers)):
        raise ExportError(f"MoE layers {sorted(sparse)} are not the last ones of {layers}")
    settle(cfg, "first_k_dense_replace", first, "the first layer with experts")
    shared = shapes.first(SHARED_GATE)
    if shared is not None:
        width = cfg["moe_intermediate_size"]
        settle(cfg, "n_shared_experts", shared[1][0] // width, f"{shared[0]} rows / {width}")


ARCH = Architecture(
    name="deepseek_v3",
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    rules=(
        layer("self_attn.q_proj.weight", "attention.wq.weight"),
        layer("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
        layer("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
        layer("self_attn.q_b_proj.weight", "attention.wq_b.weight"),
        layer("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
        layer("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
        layer("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
        layer("self_attn.o_proj.weight", "attention.wo.weight"),
        Rule(HF_LAYER + "self_attn.rotary_emb.inv_freq", None, note="RoPE cache, recomputed"),
        *decoder.DENSE_MLP,
        layer(EXPERT + "gate_proj.weight", INNER + "w1_EFD", EXPERTS),
        layer(EXPERT + "up_proj.weight", INNER + "w3_EFD", EXPERTS),
        layer(EXPERT + "down_proj.weight", INNER + "w2_EDF", EXPERTS),
        layer("mlp.gate.weight", "moe.router.gate.weight"),
        layer("mlp.gate.e_score_correction_bias", "moe.expert_bias_E"),
        layer("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
        layer("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
        layer("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
        Rule(
            None,
            "layers.{layer}.moe.tokens_per_expert_E",
            note="torchtitan's per-step expert token counts (not a weight)",
        ),
        *decoder.NORMS_AND_ENDS,
    ),
    fields=(
        *decoder.FIELDS,
        Field(
            "kv_lora_rank",
            "latent kv width",
            shape=(HF_LAYER + "self_attn.kv_a_layernorm.weight", 0),
        ),
        Field(
            "q_lora_rank", "latent q width", shape=(HF_LAYER + "self_attn.q_a_layernorm.weight", 0)
        ),
        Field("n_routed_experts", "routed experts per MoE layer", count=(EXPERT_GATE, "expert")),
        Field("moe_intermediate_size", "expert MLP width", shape=(EXPERT_GATE, 0)),
        Field("num_experts_per_tok", "experts each token is routed to (top-k)", required=True),
        Field("n_group", "expert groups", advice="transformers will use its default"),
        Field(
            "topk_group", "groups each token may use", advice="transformers will use its default"
        ),
        Field(
            "routed_scaling_factor",
            "routed expert weight scale",
            advice="transformers will use its default",
        ),
    ),
    checks=(mla, moe_layers),
    markers=(KV_A,),
)
