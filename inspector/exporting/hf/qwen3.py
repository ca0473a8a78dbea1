"""Qwen3 (dense): torchtitan ``models/qwen3`` <-> HF ``Qwen3ForCausalLM``.

Same RoPE layout on both sides (no permutation); per-head q_norm / k_norm of size head_dim.
"""

from inspector.exporting.hf import decoder
from inspector.exporting.hf.base import Architecture
from inspector.exporting.hf.config import Field, attention

QK_NORM = "model.layers.{layer}.self_attn.q_norm.weight"
HEAD_DIM = Field("head_dim", "size of one attention head", shape=(QK_NORM, 0))
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config default when a config has no head_dim

ARCH = Architecture(
    name="qwen3",
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    rules=(
        *decoder.attention(rope_permute=False),
        *decoder.QK_NORM,
        *decoder.DENSE_MLP,
        *decoder.NORMS_AND_ENDS,
    ),
    fields=(*decoder.FIELDS, HEAD_DIM),
    checks=(attention(lambda hidden, heads: QWEN3_HEAD_DIM, rope_pairs=False),),
    markers=(QK_NORM,),
)
