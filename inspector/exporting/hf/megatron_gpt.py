"""Megatron-Core GPT (``torch_dist``, local or TE spec) -> HF ``LlamaForCausalLM`` /
``Qwen3ForCausalLM``: layers stacked on a leading axis are written one layer slice at a
time, fused QKV split per query group ``[q heads of g; k_g; v_g]``, SwiGLU ``linear_fc1``
split into ``[gate; up]``, the padded vocabulary trimmed to the HF one when known.

The model facts come from the run's ``args`` (the common state's Namespace, as plain
fields) and ``hf_config``; every one is checked against the weight shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from inspector.errors import ExportError
from inspector.exporting.hf import transforms
from inspector.exporting.hf.base import EMBED, LM_HEAD, Output, Plan, TensorMeta, tensor_meta

ARCH = "megatron_gpt"
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
STACK = "decoder.layers."
QKV = STACK + "self_attention.linear_qkv.weight"
FC1 = STACK + "mlp.linear_fc1.weight"
FC2 = STACK + "mlp.linear_fc2.weight"
PROJ = STACK + "self_attention.linear_proj.weight"
Q_NORM = STACK + "self_attention.q_layernorm.weight"
HF_LAYER = "model.layers.{layer}."
# Stacked Megatron weight -> HF name (per layer) for the ones copied as they are; the local
# spec saves its norms under the TE names, older saves under their module names.
LAYER_COPIES = {
    STACK + "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    STACK + "input_layernorm.weight": "input_layernorm.weight",
    PROJ: "self_attn.o_proj.weight",
    STACK + "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    STACK + "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    FC2: "mlp.down_proj.weight",
    Q_NORM: "self_attn.q_norm.weight",
    STACK + "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
SPLITS = {
    QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
KNOWN = {EMBEDDING, OUTPUT_LAYER, FINAL_NORM, *LAYER_COPIES, *SPLITS}
REQUIRED = (EMBEDDING, FINAL_NORM, QKV, PROJ, FC1, FC2)
SUPPLY = "the run's args (common state) or hf_config"
# args field -> (HF config field, what it is); read as they are when present.
PLAIN_ARGS = {
    "max_position_embeddings": ("max_position_embeddings", "context length"),
    "rotary_base": ("rope_theta", "RoPE base"),
    "layernorm_epsilon": ("rms_norm_eps", "RMSNorm epsilon"),
}


def fits(keys: Mapping[str, Any]) -> bool:
    """Whether the model keys are Megatron-Core GPT names (its embedding and stacked layers)."""
    return EMBEDDING in keys and any(k.startswith(STACK) for k in keys)


@dataclass(frozen=True)
class Facts:
    """The model's shape facts, settled from args, hf_config and the weights."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded: int
    tied: bool


def to_hf(
    tensors: Mapping[str, Any], config: Mapping | None, args: Mapping[str, Any] | None
) -> Plan:
    """Plan Megatron GPT weights (``{key: tensor meta}``, stacked layers) -> HF names."""
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    left_out = {k: "optimizer state, not a model weight" for k in metas if k.startswith("optim")}
    model = {k: m for k, m in metas.items() if k not in left_out}
    unknown = sorted(k for k in model if k not in KNOWN)
    if unknown:
        raise ExportError(
            f"{len(unknown)} Megatron modules have no HF rule (e.g. {', '.join(unknown[:3])}): "
            "only Llama-family GPT (GQA, SwiGLU, RMSNorm, RoPE, optional qk-norm) is known",
            key=unknown[0],
        )
    for key in REQUIRED:
        if key not in model:
            raise ExportError(f"the weights have no {key}: not a whole Megatron GPT model")
    cfg = dict(config or {})
    given = dict(args or {})
    _check_args(given)
    facts = settle(model, cfg, given)
    qk_norm = Q_NORM in model
    outputs = _outputs(model, facts)
    if facts.tied and OUTPUT_LAYER in model:
        left_out[OUTPUT_LAYER] = f"tied: HF reads lm_head from {EMBED}"
    config_out, notes = _config(cfg, given, facts, qk_norm=qk_norm)
    reason = (
        f"{ARCH}: Megatron-Core GPT keys ({EMBEDDING}, {STACK}* stacked over {facts.layers} "
        f"layers); SwiGLU linear_fc1 and {'qk-norm' if qk_norm else 'no qk-norm'} make it "
        f"{config_out['architectures'][0]}"
    )
    must = ((OUTPUT_LAYER, EMBEDDING),) if facts.tied and OUTPUT_LAYER in model else ()
    return Plan(
        ARCH,
        "to_hf",
        "megatron",
        tuple(outputs),
        left_out,
        config_out,
        tuple(notes),
        reason=reason,
        must_equal=must,
    )


def _check_args(args: Mapping[str, Any]) -> None:
    """Refuse runs whose model is not the Llama family this adapter writes."""
    wrong = {
        "swiglu": (False, "a GELU MLP"),
        "normalization": ("LayerNorm", "LayerNorm"),
        "position_embedding_type": ("learned_absolute", "learned position embeddings"),
        "add_bias_linear": (True, "linear biases"),
        "add_qkv_bias": (True, "QKV biases"),
        "apply_layernorm_1p": (True, "zero-centred norms"),
        "rotary_interleaved": (True, "interleaved RoPE"),
        "multi_latent_attention": (True, "multi-latent attention"),
    }
    for field, (value, what) in wrong.items():
        if args.get(field) == value:
            raise ExportError(
                f"args.{field}={value!r}: {what} has no Llama-family HF counterpart here"
            )
    if args.get("num_experts"):
        raise ExportError(f"args.num_experts={args['num_experts']}: MoE is not supported yet")
    percent = args.get("rotary_percent", 1.0)
    if percent != 1.0:
        raise ExportError(f"args.rotary_percent={percent}: partial RoPE has no HF Llama field")


def _int(source: Mapping[str, Any], name: str) -> int | None:
    value = source.get(name)
    return value if type(value) is int else None


def _pick(
    name: str, what: str, from_args: int | None, from_config: int | None, arg: str, hf: str
) -> int:
    """One fact from args and hf_config, which must agree when both say it."""
    if from_args is not None and from_config is not None and from_args != from_config:
        raise ExportError(
            f"args.{arg}={from_args} and hf_config {hf}={from_config} disagree on {what}"
        )
    value = from_args if from_args is not None else from_config
    if value is None:
        raise ExportError(
            f"the Megatron export needs {name} ({what}): the checkpoint's common state has no "
            f"args.{arg}; pass hf_config={{'{hf}': ...}} (or hf_assets with a config.json)"
        )
    return value


def _shape(model: Mapping[str, TensorMeta], key: str, rank: int) -> tuple[int, ...]:
    shape = model[key].shape
    if len(shape) != rank:
        raise ExportError(f"has {len(shape)} dimensions, a Megatron GPT weight {rank}", key=key)
    return shape


def _agree(name: str, value: int, key: str, size: int, arg: str) -> None:
    if value != size:
        raise ExportError(
            f"{name}={value} (from {arg}) does not match the weights: {key} says {size}", key=key
        )


def settle(model: Mapping[str, TensorMeta], cfg: Mapping, args: Mapping[str, Any]) -> Facts:
    """The model facts from args and hf_config, checked against the stacked shapes."""
    padded, hidden = _shape(model, EMBEDDING, 2)
    layers_in_shape = _shape(model, QKV, 3)[0]
    layers = _pick(
        "num_hidden_layers", "decoder layers", _int(args, "num_layers"),
        _int(cfg, "num_hidden_layers"), "num_layers", "num_hidden_layers",
    )  # fmt: skip
    where = "args.num_layers" if _int(args, "num_layers") is not None else "hf_config"
    for key, meta in model.items():
        if key.startswith(STACK):
            _agree("num_layers", layers, key, meta.shape[0] if meta.shape else 0, where)
    _agree("num_layers", layers, QKV, layers_in_shape, where)
    _agree("hidden_size", _int(args, "hidden_size") or hidden, EMBEDDING, hidden, "args")
    heads = _pick(
        "num_attention_heads", "attention heads per layer", _int(args, "num_attention_heads"),
        _int(cfg, "num_attention_heads"), "num_attention_heads", "num_attention_heads",
    )  # fmt: skip
    groups_arg = _int(args, "num_query_groups") if args.get("group_query_attention") else None
    if groups_arg is None and _int(args, "num_attention_heads") is not None:
        groups_arg = heads  # Megatron's multi-head attention: one group per head
    groups = _pick(
        "num_key_value_heads", "key/value heads (query groups)", groups_arg,
        _int(cfg, "num_key_value_heads"), "num_query_groups", "num_key_value_heads",
    )  # fmt: skip
    head_dim = _int(args, "kv_channels") or _int(cfg, "head_dim") or hidden // heads
    rows, cols = _shape(model, QKV, 3)[1:]
    if heads % groups or rows != (heads + 2 * groups) * head_dim or cols != hidden:
        raise ExportError(
            f"{heads} heads in {groups} query groups of head size {head_dim} make a fused QKV "
            f"of [{(heads + 2 * groups) * head_dim}, {hidden}], the weights have [{rows}, {cols}] "
            f"({SUPPLY} give num_attention_heads / num_query_groups / kv_channels)",
            key=QKV,
        )
    ffn = _shape(model, FC2, 3)[2]
    _agree("ffn_hidden_size", _int(args, "ffn_hidden_size") or ffn, FC2, ffn, "args")
    _agree("2 x ffn_hidden_size", 2 * ffn, FC1, _shape(model, FC1, 3)[1], "linear_fc2")
    _agree(
        "padded_vocab_size", _int(args, "padded_vocab_size") or padded, EMBEDDING, padded, "args"
    )
    vocab = _int(cfg, "vocab_size") or _int(args, "vocab_size") or padded
    if vocab > padded:
        raise ExportError(
            f"vocab_size {vocab} is larger than the {padded} rows of the embedding", key=EMBEDDING
        )
    untie = args.get("untie_embeddings_and_output_weights")
    tied = (OUTPUT_LAYER not in model) if untie is None else not untie
    if cfg.get("tie_word_embeddings") is not None:
        tied = bool(cfg["tie_word_embeddings"])
    if not tied and OUTPUT_LAYER not in model:
        raise ExportError(
            f"untied embeddings (args.untie_embeddings_and_output_weights / hf_config "
            f"tie_word_embeddings) but the weights have no {OUTPUT_LAYER}"
        )
    return Facts(layers, hidden, heads, groups, head_dim, ffn, vocab, padded, tied)


def _outputs(model: Mapping[str, TensorMeta], f: Facts) -> list[Output]:
    """Every HF tensor, layer by layer, each from one layer slice of one stacked weight."""
    out = [_vocab_rows(EMBED, EMBEDDING, model, f)]
    per_group = f.heads // f.groups
    sizes = {QKV: (per_group * f.head_dim, f.head_dim, f.head_dim), FC1: (f.ffn, f.ffn)}
    for layer in range(f.layers):
        prefix = HF_LAYER.format(layer=layer)
        for key, meta in model.items():
            if key in LAYER_COPIES:
                name = prefix + LAYER_COPIES[key]
                out.append(
                    Output(name, key, transforms.copy, meta.shape[1:], meta.dtype, index=layer)
                )
            elif key in SPLITS:
                for part, name in enumerate(SPLITS[key]):
                    split = partial(
                        transforms.split_rows, groups=f.groups if key == QKV else 1,
                        sizes=sizes[key], part=part,
                    )  # fmt: skip
                    rows = sizes[key][part] * (f.groups if key == QKV else 1)
                    shape = (rows, *meta.shape[2:])
                    out.append(Output(prefix + name, key, split, shape, meta.dtype, index=layer))
    out.append(Output("model.norm.weight", FINAL_NORM, transforms.copy, *model[FINAL_NORM]))
    if not f.tied:
        out.append(_vocab_rows(LM_HEAD, OUTPUT_LAYER, model, f))
    return out


def _vocab_rows(name: str, key: str, model: Mapping[str, TensorMeta], f: Facts) -> Output:
    meta = model[key]
    if f.vocab == f.padded:
        return Output(name, key, transforms.copy, meta.shape, meta.dtype)
    trim = partial(transforms.first_rows, rows=f.vocab)
    return Output(name, key, trim, (f.vocab, *meta.shape[1:]), meta.dtype)


def _config(
    cfg: Mapping, args: Mapping[str, Any], f: Facts, *, qk_norm: bool
) -> tuple[dict, list[str]]:
    """The HF config: hf_config's fields, completed from the facts and args."""
    model_type, arch = ("qwen3", "Qwen3ForCausalLM") if qk_norm else ("llama", "LlamaForCausalLM")
    given_type = cfg.get("model_type")
    if given_type is not None and given_type != model_type:
        raise ExportError(
            f"hf_config model_type={given_type!r}, but the weights are {model_type!r} "
            f"({'with' if qk_norm else 'without'} q_layernorm/k_layernorm)"
        )
    out = dict(cfg)
    out.update(
        model_type=model_type,
        architectures=[arch],
        vocab_size=f.vocab,
        hidden_size=f.hidden,
        num_hidden_layers=f.layers,
        num_attention_heads=f.heads,
        num_key_value_heads=f.groups,
        head_dim=f.head_dim,
        intermediate_size=f.ffn,
        tie_word_embeddings=f.tied,
        hidden_act=out.get("hidden_act", "silu"),
        attention_bias=False,
        mlp_bias=False,
    )
    notes = []
    for field, (hf, what) in PLAIN_ARGS.items():
        value = args.get(field)
        if value is not None and out.get(hf) is None:
            out[hf] = value
        elif out.get(hf) is None:
            notes.append(f"neither args.{field} nor hf_config {hf} ({what}): transformers' default")
    if f.vocab == f.padded and _int(cfg, "vocab_size") is None and args.get("vocab_size") is None:
        notes.append(
            f"vocab_size stays the padded {f.padded}: pass hf_config vocab_size to trim it"
        )
    return out, notes


# --- the reverse: HF Llama / Qwen3 -> Megatron-Core GPT (torch_dist) --------------------------

HF_NAMES = {
    "input_layernorm.weight": STACK + "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": PROJ,
    "post_attention_layernorm.weight": STACK + "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": FC2,
    "self_attn.q_norm.weight": Q_NORM,
    "self_attn.k_norm.weight": STACK + "self_attention.k_layernorm.weight",
}
HF_FUSED = {
    QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
HF_IGNORED = ("self_attn.rotary_emb.inv_freq",)
# Stacked modules whose per-layer ``_extra_state`` a GPTModel's sharded state dict lists.
EXTRA_STATE_MODULES = tuple(k.removesuffix(".weight") for k in (QKV, PROJ, FC1, FC2))
VOCAB_MULTIPLE = 128  # Megatron's default make_vocab_size_divisible_by (at TP=1)


@dataclass(frozen=True)
class Piece:
    """One chunk to write: ``build([read(s) for s in sources])`` is the slice of ``key``
    (of ``full_shape``) at ``offsets``, of ``shape`` and ``dtype``."""

    key: str
    sources: tuple[str, ...]
    build: Any
    shape: tuple[int, ...]
    dtype: Any
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]


def _layer_of(name: str) -> tuple[int, str] | None:
    prefix = "model.layers."
    if not name.startswith(prefix):
        return None
    number, _, rest = name[len(prefix) :].partition(".")
    return (int(number), rest) if number.isdigit() else None


def from_hf(
    tensors: Mapping[str, Any], config: Mapping | None
) -> tuple[list[Piece], dict[str, Any], dict[str, str]]:
    """Plan HF Llama / Qwen3 weights -> Megatron GPT chunks (one per layer of each stacked
    weight); returns the pieces, the run's ``args`` fields and the HF keys left out."""
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    cfg = dict(config or {})
    left_out: dict[str, str] = {}
    layers: dict[int, dict[str, TensorMeta]] = {}
    for name, meta in metas.items():
        found = _layer_of(name)
        if found and found[1] in HF_IGNORED:
            left_out[name] = "RoPE cache, recomputed"
        elif found and (found[1] in HF_NAMES or any(found[1] in p for p in HF_FUSED.values())):
            layers.setdefault(found[0], {})[found[1]] = meta
        elif name not in (EMBED, LM_HEAD, "model.norm.weight"):
            raise ExportError("has no Megatron GPT rule (Llama / Qwen3 HF names)", key=name)
    for name in (EMBED, "model.norm.weight"):
        if name not in metas:
            raise ExportError(f"the weights have no {name}: not a whole HF Llama / Qwen3 model")
    count = len(layers)
    if sorted(layers) != list(range(count)) or count == 0:
        raise ExportError(f"the HF layers are not 0..{count - 1}: {sorted(layers)[:5]}")
    first = layers[0]
    for number, parts in layers.items():
        if set(parts) != set(first):
            missing = sorted(set(first) ^ set(parts))[0]
            raise ExportError(
                "layers differ in their weights", key=f"model.layers.{number}.{missing}"
            )
    vocab, hidden = metas[EMBED].shape
    heads = _int(cfg, "num_attention_heads")
    if heads is None:
        raise ExportError(
            "the Megatron export needs num_attention_heads: pass hf_config (or hf_assets / a "
            "config.json beside the weights)"
        )
    groups = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or hidden // heads
    q_rows = first["self_attn.q_proj.weight"].shape[0]
    k_rows = first["self_attn.k_proj.weight"].shape[0]
    if q_rows != heads * head_dim or k_rows != groups * head_dim or heads % groups:
        raise ExportError(
            f"hf_config num_attention_heads={heads} / num_key_value_heads={groups} / head_dim="
            f"{head_dim} do not fit q_proj [{q_rows}, ...] and k_proj [{k_rows}, ...]",
            key="model.layers.0.self_attn.q_proj.weight",
        )
    ffn = first["mlp.gate_proj.weight"].shape[0]
    tied = cfg.get("tie_word_embeddings")
    tied = (LM_HEAD not in metas) if tied is None else bool(tied)
    if tied and LM_HEAD in metas:
        left_out[LM_HEAD] = (
            "tied: Megatron shares the embedding (untie_embeddings_and_output_weights false)"
        )
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    pieces = [_padded(EMBEDDING, EMBED, metas[EMBED], padded)]
    for key in (*HF_FUSED, *dict.fromkeys(HF_NAMES.values())):
        names = HF_FUSED.get(key) or tuple(
            n for n, k in HF_NAMES.items() if k == key and n in first
        )
        if not all(n in first for n in names) or not names:
            continue
        fuse = partial(transforms.fuse_rows, groups=groups if key == QKV else 1)
        metas_of = [first[n] for n in names]
        shape = (1, sum(m.shape[0] for m in metas_of), *metas_of[0].shape[1:])
        for number in range(count):
            sources = tuple(f"model.layers.{number}.{n}" for n in names)
            offsets = (number,) + (0,) * (len(shape) - 1)
            pieces.append(
                Piece(key, sources, fuse, shape, metas_of[0].dtype, offsets, (count, *shape[1:]))
            )
    pieces.append(
        Piece(
            FINAL_NORM, ("model.norm.weight",), transforms.only, *_whole(metas["model.norm.weight"])
        )
    )
    if not tied:
        if LM_HEAD not in metas:
            raise ExportError(f"hf_config tie_word_embeddings is false, but there is no {LM_HEAD}")
        pieces.append(_padded(OUTPUT_LAYER, LM_HEAD, metas[LM_HEAD], padded))
    dtype = metas[EMBED].dtype
    rope: dict = cfg["rope_parameters"] if isinstance(cfg.get("rope_parameters"), dict) else {}
    args = {
        "num_layers": count, "hidden_size": hidden, "ffn_hidden_size": ffn,
        "num_attention_heads": heads, "num_query_groups": groups,
        "group_query_attention": groups != heads, "kv_channels": head_dim,
        "vocab_size": vocab, "padded_vocab_size": padded,
        "make_vocab_size_divisible_by": VOCAB_MULTIPLE,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "seq_length": cfg.get("max_position_embeddings"),
        "rotary_base": cfg.get("rope_theta") or rope.get("rope_theta"),
        "layernorm_epsilon": cfg.get("rms_norm_eps"), "swiglu": True,
        "untie_embeddings_and_output_weights": not tied, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_interleaved": False,
        "add_bias_linear": False, "add_qkv_bias": False, "apply_layernorm_1p": False,
        "qk_layernorm": "self_attn.q_norm.weight" in first, "multi_latent_attention": False,
        "num_experts": None, "params_dtype": dtype, "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "ckpt_format": "torch_dist",
    }  # fmt: skip
    return pieces, args, left_out


def _whole(meta: TensorMeta) -> tuple[tuple[int, ...], Any, tuple[int, ...], tuple[int, ...]]:
    return meta.shape, meta.dtype, (0,) * len(meta.shape), meta.shape


def _padded(key: str, source: str, meta: TensorMeta, padded: int) -> Piece:
    shape = (padded, *meta.shape[1:])
    pad = partial(transforms.pad_rows, rows=padded)
    return Piece(key, (source,), pad, shape, meta.dtype, (0,) * len(shape), shape)
