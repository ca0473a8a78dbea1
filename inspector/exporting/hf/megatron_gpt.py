"""Megatron-Core GPT (``torch_dist``, local or TE spec) -> HF Llama / Qwen3 (qk-norm) /
Qwen2 (QKV biases) and the MoE Qwen3-MoE / Mixtral / Qwen2-MoE (:mod:`.megatron_moe`):
layers stacked on a leading axis are written one layer slice at a time, fused QKV (and its
bias) split per query group ``[q heads of g; k_g; v_g]``, SwiGLU ``linear_fc1`` split into
``[gate; up]``, the padded vocabulary trimmed to the HF one when known.

The model facts come from the run's ``args`` (the common state's Namespace, as plain
fields) and ``hf_config``; every one is checked against the weight shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from inspector.errors import ExportError
from inspector.exporting.hf import megatron_moe as moe
from inspector.exporting.hf import transforms
from inspector.exporting.hf.base import EMBED, LM_HEAD, Output, Plan, TensorMeta, tensor_meta

ARCH = "megatron_gpt"
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
STACK = moe.STACK
QKV = STACK + "self_attention.linear_qkv.weight"
QKV_BIAS = STACK + "self_attention.linear_qkv.bias"
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
    QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
KNOWN = {EMBEDDING, OUTPUT_LAYER, FINAL_NORM, *LAYER_COPIES, *SPLITS, *moe.KEYS}
REQUIRED = (EMBEDDING, FINAL_NORM, QKV, PROJ)
# HF family -> (model_type, architecture)
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
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
    family: str = "llama"
    moe: moe.MoeFacts | None = None
    bias: bool = False


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
    outputs = _outputs(model, facts)
    if facts.tied and OUTPUT_LAYER in model:
        left_out[OUTPUT_LAYER] = f"tied: HF reads lm_head from {EMBED}"
    config_out, notes = _config(cfg, given, facts)
    reason = (
        f"{ARCH}: Megatron-Core GPT keys ({EMBEDDING}, {STACK}* stacked over {facts.layers} "
        f"layers); {_traits(model, facts)} make it {config_out['architectures'][0]}"
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


def _traits(model: Mapping[str, TensorMeta], f: Facts) -> str:
    """What decided the HF family, in words."""
    found = [
        "qk-norm" if Q_NORM in model else "no qk-norm",
        "QKV biases" if QKV_BIAS in model else "no QKV biases",
        f"{f.moe.experts} routed experts (top-{f.moe.topk})" if f.moe else "SwiGLU linear_fc1",
    ]
    if f.moe and f.moe.shared:
        found.append("a gated shared expert")
    return ", ".join(found)


def family(model: Mapping[str, TensorMeta], args: Mapping[str, Any]) -> str:
    """The HF family the weights' modules make: qk-norm, QKV biases, routed and shared experts."""
    qk_norm, bias = Q_NORM in model, QKV_BIAS in model
    if args.get("add_qkv_bias") is not None and bool(args["add_qkv_bias"]) != bias:
        raise ExportError(
            f"args.add_qkv_bias={args['add_qkv_bias']!r}, but the weights "
            f"{'have' if bias else 'have no'} {QKV_BIAS}",
            key=QKV_BIAS if bias else QKV,
        )
    if moe.ROUTER not in model:
        if qk_norm and bias:
            raise ExportError("qk-norm with QKV biases has no HF class here (Qwen3 or Qwen2)",
                              key=QKV_BIAS)  # fmt: skip
        return "qwen3" if qk_norm else "qwen2" if bias else "llama"
    if moe.SHARED_FC1 in model:
        if moe.SHARED_GATE not in model or qk_norm:
            raise ExportError(
                "a shared expert is Qwen2-MoE's, which gates it (shared_experts.gate_weight, "
                "--moe-shared-expert-gate) and has no qk-norm",
                key=moe.SHARED_FC1,
            )
        return "qwen2_moe"
    if bias:
        raise ExportError("MoE with QKV biases but no shared expert has no HF class here",
                          key=QKV_BIAS)  # fmt: skip
    return "qwen3_moe" if qk_norm else "mixtral"


def _check_args(args: Mapping[str, Any]) -> None:
    """Refuse runs whose model is not the Llama family this adapter writes."""
    wrong = {
        "swiglu": (False, "a GELU MLP"),
        "normalization": ("LayerNorm", "LayerNorm"),
        "position_embedding_type": ("learned_absolute", "learned position embeddings"),
        "add_bias_linear": (True, "linear biases"),
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
        moe.check_args(args)
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
    kind = family(model, args)
    routed = None
    if moe.ROUTER in model:
        routed = moe.settle(model, args, cfg, layers, hidden)
        ffn = _int(args, "ffn_hidden_size") or _int(cfg, "intermediate_size") or routed.ffn
    else:
        for key in (FC1, FC2):
            if key not in model:
                raise ExportError(f"the weights have no {key} (nor an MoE router)")
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
    return Facts(
        layers, hidden, heads, groups, head_dim, ffn, vocab, padded, tied, kind, routed,
        QKV_BIAS in model,
    )  # fmt: skip


def _outputs(model: Mapping[str, TensorMeta], f: Facts) -> list[Output]:
    """Every HF tensor, layer by layer, each from one layer slice of one stacked weight, in
    the rule tables' order: the same file whatever the source's key order (TP, PP, EP)."""
    out = [_vocab_rows(EMBED, EMBEDDING, model, f)]
    per_group = f.heads // f.groups
    qkv = (per_group * f.head_dim, f.head_dim, f.head_dim)
    sizes = {QKV: qkv, QKV_BIAS: qkv, FC1: (f.ffn, f.ffn)}
    for layer in range(f.layers):
        prefix = HF_LAYER.format(layer=layer)
        for key in (k for k in (*LAYER_COPIES, *SPLITS) if k in model):
            meta = model[key]
            if key in LAYER_COPIES:
                name = prefix + LAYER_COPIES[key]
                out.append(
                    Output(name, key, transforms.copy, meta.shape[1:], meta.dtype, index=layer)
                )
            elif key in SPLITS:
                for part, name in enumerate(SPLITS[key]):
                    groups = 1 if key == FC1 else f.groups
                    split = partial(
                        transforms.split_rows, groups=groups, sizes=sizes[key], part=part
                    )
                    shape = (sizes[key][part] * groups, *meta.shape[2:])
                    out.append(Output(prefix + name, key, split, shape, meta.dtype, index=layer))
        if f.moe:
            out += moe.outputs(model, f.family, f.moe, layer, prefix)
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


def _config(cfg: Mapping, args: Mapping[str, Any], f: Facts) -> tuple[dict, list[str]]:
    """The HF config: hf_config's fields, completed from the facts and args."""
    model_type, arch = FAMILIES[f.family]
    given_type = cfg.get("model_type")
    if given_type is not None and given_type != model_type:
        raise ExportError(
            f"hf_config model_type={given_type!r}, but the weights are {model_type!r} "
            "(from their qk-norm, QKV biases and experts)"
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
    )
    if f.family in ("llama", "qwen3", "qwen3_moe"):
        out.update(attention_bias=False)
    if f.family == "llama":
        out.update(mlp_bias=False)
    if f.family == "qwen2_moe":
        out.update(qkv_bias=f.bias)
    if f.moe:
        out.update(moe.hf_config(f.family, args, f.moe, f.ffn))
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
    QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    moe.SHARED_FC1: moe.SHARED,
}
HF_STACKED = {
    moe.SHARED_FC2: moe.SHARED_DOWN,
    moe.SHARED_GATE: moe.SHARED_HF_GATE,
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


@dataclass(frozen=True)
class MegatronPlan:
    """The chunks to write, the run's ``args`` (``params_dtype`` as a dtype name, a
    ``torch.dtype`` only in the written common state), the HF keys left out (and why), the stacked
    modules with an ``_extra_state`` per layer (-> experts per layer, 0 for one per layer)
    and why the HF model was read as it was."""

    pieces: list[Piece]
    args: dict[str, Any]
    left_out: dict[str, str]
    modules: dict[str, int]
    reason: str


def _layer_of(name: str) -> tuple[int, str] | None:
    prefix = "model.layers."
    if not name.startswith(prefix):
        return None
    number, _, rest = name[len(prefix) :].partition(".")
    return (int(number), rest) if number.isdigit() else None


def _known_layer_name(rest: str) -> bool:
    fused = any(rest in parts for parts in HF_FUSED.values())
    return rest in HF_NAMES or fused or moe.is_moe_name(rest)


def from_hf(tensors: Mapping[str, Any], config: Mapping | None) -> MegatronPlan:
    """Plan HF Llama / Qwen3 / Qwen2 / Qwen3-MoE / Mixtral / Qwen2-MoE weights -> Megatron GPT
    chunks (one per layer, and per expert, of each stacked weight)."""
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    cfg = dict(config or {})
    left_out: dict[str, str] = {}
    layers: dict[int, dict[str, TensorMeta]] = {}
    for name, meta in metas.items():
        found = _layer_of(name)
        if found and found[1] in HF_IGNORED:
            left_out[name] = "RoPE cache, recomputed"
        elif found and _known_layer_name(found[1]):
            layers.setdefault(found[0], {})[found[1]] = meta
        elif name not in (EMBED, LM_HEAD, "model.norm.weight"):
            raise ExportError(
                "has no Megatron GPT rule (Llama / Qwen3 / Qwen2 / Qwen3-MoE / Mixtral / "
                "Qwen2-MoE HF names)",
                key=name,
            )
    for name in (EMBED, "model.norm.weight"):
        if name not in metas:
            raise ExportError(f"the weights have no {name}: not a whole HF decoder model")
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
    kind = moe.family_of(first)
    tied = cfg.get("tie_word_embeddings")
    tied = (LM_HEAD not in metas) if tied is None else bool(tied)
    if tied and LM_HEAD in metas:
        left_out[LM_HEAD] = (
            "tied: Megatron shares the embedding (untie_embeddings_and_output_weights false)"
        )
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    pieces = [_padded(EMBEDDING, EMBED, metas[EMBED], padded)]
    pieces += _layer_pieces(first, count, groups)
    modules = dict.fromkeys(
        (m for m in EXTRA_STATE_MODULES if f"{m}.weight" in {p.key for p in pieces}), 0
    )
    moe_args: dict[str, Any] = {"num_experts": None}
    if kind is not None:
        experts = moe.expert_count(first, kind)
        pieces += _expert_pieces(first, count, kind, experts)
        moe_args = _moe_args(cfg, first, kind, experts)
        modules |= dict.fromkeys(moe.EXPERT_MODULES, experts)
        if moe.SHARED[0] in first:
            modules |= dict.fromkeys(moe.SHARED_MODULES, 0)
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
    ffn = first["mlp.gate_proj.weight"].shape[0] if kind is None else moe_args.pop("ffn")
    bias = "self_attn.q_proj.bias" in first
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
        "add_bias_linear": False, "add_qkv_bias": bias, "apply_layernorm_1p": False,
        "qk_layernorm": "self_attn.q_norm.weight" in first, "multi_latent_attention": False,
        "params_dtype": dtype, "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16", "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "ckpt_format": "torch_dist",
    } | moe_args  # fmt: skip
    traits = f"{'with' if bias else 'no'} QKV biases"
    if kind is not None:
        traits += f", {moe_args['num_experts']} experts per layer ({kind} names)"
    reason = f"HF decoder of {count} layers, {traits}"
    return MegatronPlan(pieces, args, left_out, modules, reason)


def _layer_pieces(first: Mapping[str, TensorMeta], count: int, groups: int) -> list[Piece]:
    """One chunk per layer of each stacked dense weight (fused QKV / fc1, copies)."""
    pieces = []
    singles = {k: (n,) for k, n in HF_STACKED.items()}
    for key in (*HF_FUSED, *dict.fromkeys(HF_NAMES.values()), *singles):
        names = HF_FUSED.get(key) or singles.get(key) or tuple(
            n for n, k in HF_NAMES.items() if k == key and n in first
        )
        if not names or not all(n in first for n in names):
            continue
        fuse = partial(transforms.fuse_rows, groups=groups if key in (QKV, QKV_BIAS) else 1)
        metas_of = [first[n] for n in names]
        shape = (1, sum(m.shape[0] for m in metas_of), *metas_of[0].shape[1:])
        for number in range(count):
            sources = tuple(f"model.layers.{number}.{n}" for n in names)
            offsets = (number,) + (0,) * (len(shape) - 1)
            pieces.append(
                Piece(key, sources, fuse, shape, metas_of[0].dtype, offsets, (count, *shape[1:]))
            )
    return pieces


def _expert_pieces(
    first: Mapping[str, TensorMeta], count: int, kind: str, experts: int
) -> list[Piece]:
    """The router per layer and each expert's fc1 ([gate; up]) and fc2 per layer."""
    names = moe.NAMES[kind]
    router = first[names.router]
    shape = (1, *router.shape)
    stack = partial(transforms.fuse_rows, groups=1)
    pieces = [
        Piece(moe.ROUTER, (f"model.layers.{n}.{names.router}",), stack, shape, router.dtype,
              (n, 0, 0), (count, *router.shape))
        for n in range(count)
    ]  # fmt: skip
    for key, parts in ((moe.EXPERT_FC1, (names.gate, names.up)), (moe.EXPERT_FC2, (names.down,))):
        metas_of = [first[p.format(e=0)] for p in parts]
        rows = sum(m.shape[0] for m in metas_of)
        shape = (1, 1, rows, metas_of[0].shape[1])
        full = (count, experts, rows, metas_of[0].shape[1])
        for n in range(count):
            for e in range(experts):
                sources = tuple(f"model.layers.{n}.{p.format(e=e)}" for p in parts)
                pieces.append(Piece(key, sources, transforms.fuse_expert, shape,
                                    metas_of[0].dtype, (n, e, 0, 0), full))  # fmt: skip
    return pieces


def _moe_args(
    cfg: Mapping, first: Mapping[str, TensorMeta], kind: str, experts: int
) -> dict[str, Any]:
    """The run's MoE args (and ``ffn``, the dense width Megatron's ffn_hidden_size holds)."""
    names = moe.NAMES[kind]
    topk = _int(cfg, "num_experts_per_tok")
    if topk is None:
        raise ExportError(
            "the Megatron MoE export needs num_experts_per_tok (top-k): pass hf_config (or "
            "hf_assets / a config.json beside the weights)"
        )
    given = _int(cfg, "num_experts") or _int(cfg, "num_local_experts")
    if given is not None and given != experts:
        raise ExportError(
            f"hf_config num_experts={given}, but layer 0 has {experts} experts",
            key=f"model.layers.0.{names.down.format(e=experts - 1)}",
        )
    moe_ffn = first[names.gate.format(e=0)].shape[0]
    shared = first[moe.SHARED[0]].shape[0] if moe.SHARED[0] in first else None
    # Mixtral always renormalises the top-k weights, as Megatron's default routing does
    normalise = kind == "mixtral" or bool(cfg.get("norm_topk_prob"))
    return {
        "num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": moe_ffn,
        "moe_router_pre_softmax": not normalise, "moe_router_score_function": "softmax",
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": shared is not None, "moe_layer_freq": 1,
        "moe_grouped_gemm": False, "expert_model_parallel_size": 1,
        "ffn": _int(cfg, "intermediate_size") or moe_ffn,
    }  # fmt: skip


def _whole(meta: TensorMeta) -> tuple[tuple[int, ...], Any, tuple[int, ...], tuple[int, ...]]:
    return meta.shape, meta.dtype, (0,) * len(meta.shape), meta.shape


def _padded(key: str, source: str, meta: TensorMeta, padded: int) -> Piece:
    shape = (padded, *meta.shape[1:])
    pad = partial(transforms.pad_rows, rows=padded)
    return Piece(key, (source,), pad, shape, meta.dtype, (0,) * len(shape), shape)
