"""Llama 3: torchtitan ``models/llama3`` <-> HF ``LlamaForCausalLM``.

torchtitan's RoPE rotates interleaved pairs, HF's rotates halves: q/k rows are permuted
per head (needs num_attention_heads and num_key_value_heads).
"""

from inspector.exporting.hf import decoder
from inspector.exporting.hf.base import Architecture
from inspector.exporting.hf.config import attention

ARCH = Architecture(
    name="llama3",
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    rules=(*decoder.attention(rope_permute=True), *decoder.DENSE_MLP, *decoder.NORMS_AND_ENDS),
    fields=decoder.FIELDS,
    checks=(attention(lambda hidden, heads: hidden // heads, rope_pairs=True),),
)
