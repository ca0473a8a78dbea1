"""Rules and fields shared by the Llama-style decoders (llama3, qwen3, qwen3_moe): the HF
names and torchtitan's names in ``models/<arch>/state_dict_adapter.py`` (0.3 and v0.2.0)."""

from __future__ import annotations

from inspector.exporting.hf.base import COPY, ROPE_K, ROPE_Q, Rule
from inspector.exporting.hf.config import Field

HF_LAYER = "model.layers.{layer}."
TT_LAYER = "layers.{layer}."


def layer(hf: str, titan: str, kind: str = COPY) -> Rule:
    """A rule for a weight inside decoder layer ``{layer}`` (torchtitan 0.3 name)."""
    return Rule(HF_LAYER + hf, TT_LAYER + titan, kind)


def attention(*, rope_permute: bool) -> tuple[Rule, ...]:
    """q/k/v/o projections; ``rope_permute``: torchtitan's RoPE pairs rows differently."""
    q, k = (ROPE_Q, ROPE_K) if rope_permute else (COPY, COPY)
    qkv = "attention.qkv_linear."  # torchtitan 0.3's QKVLinear
    return (
        layer("self_attn.q_proj.weight", qkv + "wq.weight", q),
        layer("self_attn.k_proj.weight", qkv + "wk.weight", k),
        layer("self_attn.v_proj.weight", qkv + "wv.weight"),
        layer("self_attn.o_proj.weight", "attention.wo.weight"),
        Rule(HF_LAYER + "self_attn.rotary_emb.inv_freq", None, note="RoPE cache, recomputed"),
    )


QK_NORM = (
    layer("self_attn.q_norm.weight", "attention.q_norm.weight"),
    layer("self_attn.k_norm.weight", "attention.k_norm.weight"),
)

DENSE_MLP = (
    layer("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    layer("mlp.up_proj.weight", "feed_forward.w3.weight"),
    layer("mlp.down_proj.weight", "feed_forward.w2.weight"),
)

NORMS_AND_ENDS = (
    layer("input_layernorm.weight", "attention_norm.weight"),
    layer("post_attention_layernorm.weight", "ffn_norm.weight"),
    Rule("model.embed_tokens.weight", "tok_embeddings.weight"),
    Rule("model.norm.weight", "norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
)

FIELDS = (
    Field("vocab_size", "vocabulary size", shape=("model.embed_tokens.weight", 0)),
    Field("hidden_size", "model width", shape=("model.embed_tokens.weight", 1)),
    Field(
        "num_hidden_layers", "decoder layers", count=(HF_LAYER + "input_layernorm.weight", "layer")
    ),
    Field("intermediate_size", "dense MLP width", shape=(HF_LAYER + "mlp.gate_proj.weight", 0)),
    Field("rms_norm_eps", "RMSNorm epsilon", advice="transformers will use its default"),
    Field(
        "rope_theta",
        "RoPE base",
        aliases=("rope_parameters",),
        advice="transformers will use its default (torchtitan's differ: llama3 500000, qwen3 1e6)",
    ),
)
