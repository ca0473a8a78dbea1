"""Megatron-Core MoE layers <-> HF Qwen3-MoE / Mixtral / Qwen2-MoE: the router, the routed
experts (saved by SequentialMLP and the grouped-GEMM TEGroupedMLP alike as
``mlp.experts.experts.linear_fc{1,2}.weight`` stacked [layers, experts, ...]) and Qwen2-MoE's
gated shared expert; one HF tensor per expert, read one layer slice at a time."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from inspector.errors import ExportError
from inspector.exporting.hf import transforms
from inspector.exporting.hf.base import Output, TensorMeta

STACK = "decoder.layers."
ROUTER = STACK + "mlp.router.weight"
EXPERT_FC1 = STACK + "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = STACK + "mlp.experts.experts.linear_fc2.weight"
SHARED_FC1 = STACK + "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = STACK + "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = STACK + "mlp.shared_experts.gate_weight"
KEYS = (ROUTER, EXPERT_FC1, EXPERT_FC2, SHARED_FC1, SHARED_FC2, SHARED_GATE)
# Stacked modules whose per-layer (per-expert) ``_extra_state`` a GPTModel's sharded state lists.
EXPERT_MODULES = tuple(k.removesuffix(".weight") for k in (EXPERT_FC1, EXPERT_FC2))
SHARED_MODULES = tuple(k.removesuffix(".weight") for k in (SHARED_FC1, SHARED_FC2))


@dataclass(frozen=True)
class Names:
    """One HF MoE family's per-layer names (``{e}``: the expert)."""

    router: str
    gate: str
    up: str
    down: str


QWEN = Names(
    "mlp.gate.weight",
    "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
)
MIXTRAL = Names(
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.{e}.w1.weight",
    "block_sparse_moe.experts.{e}.w3.weight",
    "block_sparse_moe.experts.{e}.w2.weight",
)
NAMES = {"qwen3_moe": QWEN, "qwen2_moe": QWEN, "mixtral": MIXTRAL}
SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
SHARED_DOWN = "mlp.shared_expert.down_proj.weight"
SHARED_HF_GATE = "mlp.shared_expert_gate.weight"
EXPERT_NAME = re.compile(r"(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class MoeFacts:
    """Experts per layer, their width, top-k and the shared expert's width (0: none)."""

    experts: int
    ffn: int
    topk: int
    shared: int


def settle(
    model: Mapping[str, TensorMeta], args: Mapping[str, Any], cfg: Mapping, layers: int, hidden: int
) -> MoeFacts:
    """The MoE facts from the stacked shapes, checked against args and hf_config."""
    for key in (ROUTER, EXPERT_FC1, EXPERT_FC2):
        if key not in model:
            raise ExportError(f"the weights have {ROUTER} but no {key}: not a whole MoE layer")
    router = model[ROUTER].shape
    if len(router) != 3 or router[2] != hidden:
        raise ExportError(f"is {list(router)}, not [layers, experts, {hidden}]", key=ROUTER)
    experts = router[1]
    _agree("num_experts", args.get("num_experts"), experts, ROUTER, "args.num_experts")
    given = cfg.get("num_experts") or cfg.get("num_local_experts")
    _agree("num_experts", given, experts, ROUTER, "hf_config num_experts")
    fc2 = model[EXPERT_FC2].shape
    if len(fc2) != 4 or fc2[:3] != (layers, experts, hidden):
        raise ExportError(
            f"is {list(fc2)}, not [{layers} layers, {experts} experts (the router's), {hidden}, "
            "ffn]",
            key=EXPERT_FC2,
        )
    ffn = fc2[3]
    _agree("moe_ffn_hidden_size", args.get("moe_ffn_hidden_size"), ffn, EXPERT_FC2, "args")
    if model[EXPERT_FC1].shape != (layers, experts, 2 * ffn, hidden):
        raise ExportError(
            f"is {list(model[EXPERT_FC1].shape)}, not [{layers}, {experts} experts (the "
            f"router's), 2 x {ffn}, {hidden}] (SwiGLU [gate; up] of {EXPERT_FC2})",
            key=EXPERT_FC1,
        )
    topk = args.get("moe_router_topk") or cfg.get("num_experts_per_tok")
    if type(topk) is not int:
        raise ExportError(
            "the Megatron MoE export needs num_experts_per_tok (top-k): the common state has "
            "no args.moe_router_topk; pass hf_config={'num_experts_per_tok': ...}"
        )
    shared = 0
    if SHARED_FC2 in model:
        shared = model[SHARED_FC2].shape[-1]
        given_shared = args.get("moe_shared_expert_intermediate_size")
        _agree("moe_shared_expert_intermediate_size", given_shared, shared, SHARED_FC2, "args")
    return MoeFacts(experts, ffn, topk, shared)


def _agree(name: str, given: Any, size: int, key: str, where: str) -> None:
    if type(given) is int and given != size:
        raise ExportError(
            f"{name}={given} (from {where}) does not match the weights: {key} says {size}",
            key=key,
        )


def check_args(args: Mapping[str, Any]) -> None:
    """Refuse routers HF's MoE classes do not compute the same way."""
    score = args.get("moe_router_score_function", "softmax")
    if score != "softmax":
        raise ExportError(f"args.moe_router_score_function={score!r}: HF routes with softmax")
    scale = args.get("moe_router_topk_scaling_factor")
    if scale not in (None, 1.0):
        raise ExportError(f"args.moe_router_topk_scaling_factor={scale}: HF does not scale")
    for field in ("moe_router_num_groups", "moe_router_group_topk"):
        if args.get(field):
            raise ExportError(f"args.{field}={args[field]}: group-limited routing has no HF field")
    freq = args.get("moe_layer_freq", 1)
    if freq != 1:
        raise ExportError(f"args.moe_layer_freq={freq!r}: mixed dense and MoE layers")


def outputs(
    model: Mapping[str, TensorMeta], family: str, facts: MoeFacts, layer: int, prefix: str
) -> list[Output]:
    """One layer's router, experts (one HF tensor each) and shared expert."""
    names = NAMES[family]
    router = model[ROUTER]
    out = [Output(prefix + names.router, ROUTER, transforms.copy, router.shape[1:], router.dtype,
                  index=layer)]  # fmt: skip
    fc1, fc2 = model[EXPERT_FC1], model[EXPERT_FC2]
    sizes = (facts.ffn, facts.ffn)
    for e in range(facts.experts):
        for part, name in enumerate((names.gate, names.up)):
            split = partial(transforms.expert_rows, index=e, sizes=sizes, part=part)
            shape = (facts.ffn, fc1.shape[3])
            out.append(
                Output(prefix + name.format(e=e), EXPERT_FC1, split, shape, fc1.dtype, index=layer)
            )
    for e in range(facts.experts):
        pick = partial(transforms.expert, index=e)
        out.append(Output(prefix + names.down.format(e=e), EXPERT_FC2, pick, fc2.shape[2:],
                          fc2.dtype, index=layer))  # fmt: skip
    if facts.shared:
        shared = model[SHARED_FC1]
        for part, name in enumerate(SHARED):
            split = partial(transforms.split_rows, groups=1, sizes=(facts.shared,) * 2, part=part)
            out.append(Output(prefix + name, SHARED_FC1, split, (facts.shared, shared.shape[2]),
                              shared.dtype, index=layer))  # fmt: skip
        down, gate = model[SHARED_FC2], model[SHARED_GATE]
        out.append(Output(prefix + SHARED_DOWN, SHARED_FC2, transforms.copy, down.shape[1:],
                          down.dtype, index=layer))  # fmt: skip
        out.append(Output(prefix + SHARED_HF_GATE, SHARED_GATE, transforms.copy, gate.shape[1:],
                          gate.dtype, index=layer))  # fmt: skip
    return out


def hf_config(family: str, args: Mapping[str, Any], facts: MoeFacts, dense_ffn: int) -> dict:
    """The HF MoE family's config fields from the facts (and the router's normalisation)."""
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    if family == "mixtral":
        if pre_softmax:
            raise ExportError(
                "args.moe_router_pre_softmax=True: Mixtral always renormalises its top-k "
                "weights (Megatron's default routing), so it would route differently"
            )
        return {"num_local_experts": facts.experts, "num_experts_per_tok": facts.topk,
                "intermediate_size": facts.ffn}  # fmt: skip
    # num_local_experts: transformers 5's name; num_experts: its alias and the older name
    fields = {
        "num_experts": facts.experts, "num_local_experts": facts.experts,
        "num_experts_per_tok": facts.topk, "moe_intermediate_size": facts.ffn,
        "intermediate_size": dense_ffn, "norm_topk_prob": not pre_softmax,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }  # fmt: skip
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = facts.shared
    return fields


# --- the reverse: HF MoE layers -> Megatron chunks --------------------------------------------


def family_of(first_layer: Mapping[str, Any]) -> str | None:
    """The HF MoE family of one layer's weight names (None: a dense layer)."""
    if MIXTRAL.router in first_layer:
        return "mixtral"
    if QWEN.router in first_layer:
        return "qwen2_moe" if SHARED_HF_GATE in first_layer else "qwen3_moe"
    return None


def is_moe_name(rest: str) -> bool:
    """Whether a layer's weight name (after ``model.layers.<i>.``) is an MoE one."""
    shared = (*SHARED, SHARED_DOWN, SHARED_HF_GATE)
    return rest in (QWEN.router, MIXTRAL.router, *shared) or bool(EXPERT_NAME.fullmatch(rest))


def expert_count(first_layer: Mapping[str, Any], family: str) -> int:
    """The experts of one layer, numbered 0..E-1 with all three weights each."""
    names = NAMES[family]
    found = {int(m.group(2)) for n in first_layer if (m := EXPERT_NAME.fullmatch(n))}
    count = len(found)
    for e in range(count):
        for name in (names.gate, names.up, names.down):
            if name.format(e=e) not in first_layer:
                raise ExportError("is missing (the experts are not 0..n-1 with all weights)",
                                  key=f"model.layers.0.{name.format(e=e)}")  # fmt: skip
    return count
