"""HF config fields an architecture needs: read from a config dict, derived from weight
shapes where the shapes tell, and checked against them (a mismatch names the field)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ExportError
from inspector.exporting.hf.names import abstract, slot_values, template_form

SUPPLY = "pass it in hf_config (a dict or a config.json path) or give hf_assets with a config.json"


@dataclass(frozen=True)
class Field:
    """One config field. ``shape``: (HF name template, axis) whose size it must equal;
    ``count``: the template slot (``layer`` / ``expert``) whose number of values it equals;
    ``required``: needed although the shapes cannot tell it; ``advice``: said when absent."""

    name: str
    what: str
    shape: tuple[str, int] | None = None
    count: tuple[str, str] | None = None
    aliases: tuple[str, ...] = ()
    required: bool = False
    advice: str = ""


class Shapes:
    """HF tensor names -> shapes, searchable by template."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)
        self.by_form: dict[str, list[str]] = {}
        for name in self.shapes:
            self.by_form.setdefault(abstract(name), []).append(name)

    def instances(self, template: str) -> Iterator[tuple[str, dict[str, int], tuple[int, ...]]]:
        form, slots = template_form(template)
        for name in self.by_form.get(form, ()):
            yield name, slot_values(name, slots), self.shapes[name]

    def first(self, template: str) -> tuple[str, tuple[int, ...]] | None:
        return next(((name, shape) for name, _, shape in self.instances(template)), None)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes


def lookup(cfg: Mapping[str, Any], field: Field) -> tuple[str, Any]:
    """(the spelling the config uses, its value); (field.name, None) when absent."""
    for key in (field.name, *field.aliases):
        if cfg.get(key) is not None:
            return key, cfg[key]
    return field.name, None


def missing(arch: str, name: str, what: str, hint: str = "") -> ExportError:
    return ExportError(f"the {arch} export needs {name} ({what}){hint}: {SUPPLY}")


def mismatch(name: str, given: Any, derived: Any, why: str, key: str | None = None) -> ExportError:
    return ExportError(
        f"hf_config {name}={given!r} does not match the weights: {why} gives {derived!r}", key=key
    )


def settle(cfg: dict, name: str, value: Any, why: str, key: str | None = None) -> None:
    """Fill ``name`` with the value the weights imply, or refuse a config that says otherwise."""
    given = cfg.get(name)
    if given is not None and given != value:
        raise mismatch(name, given, value, why, key)
    cfg[name] = value


# The config's sizes an export multiplies, divides or allocates by: when given, each must be
# a whole number from its least value to SIZE_LIMIT (a hostile config.json is not a crash).
SIZES = dict.fromkeys(
    ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
     "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size",
     "num_experts", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
     "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
     "decoder_sparse_step"),
    1,
) | {"first_k_dense_replace": 0, "n_shared_experts": 0}
SIZE_LIMIT = 1 << 40


def check_sizes(cfg: Mapping) -> None:
    """Refuse a size in ``cfg`` that is not a whole number in its range (see :data:`SIZES`)."""
    for name, least in SIZES.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not (
            least <= value <= SIZE_LIMIT
        ):
            raise ExportError(
                f"hf_config {name}={value!r} is not a whole number from {least} to {SIZE_LIMIT}"
            )


def resolve(
    arch: str, model_type: str, fields: tuple[Field, ...], config: Mapping | None, shapes: Shapes
) -> tuple[dict, list[str]]:
    """``config`` completed from the shapes and checked against them; plus notes on
    absent fields that transformers will default."""
    cfg = dict(config or {})
    check_sizes(cfg)
    given_type = cfg.get("model_type")
    if given_type is not None and given_type != model_type:
        raise ExportError(
            f"hf_config model_type={given_type!r} is not {model_type!r}, the {arch} HF model type"
        )
    notes = []
    for field in fields:
        key, given = lookup(cfg, field)
        derived = derive(field, shapes)
        if derived is None:
            if given is None and field.required:
                raise missing(arch, field.name, field.what)
            if given is None and field.advice:
                notes.append(f"hf_config has no {field.name}: {field.advice}")
            continue
        value, why, where = derived
        if given is not None and given != value:
            raise mismatch(key, given, value, why, where)
        cfg[key] = value
    return cfg, notes


def derive(field: Field, shapes: Shapes) -> tuple[int, str, str] | None:
    """(value, how it was found, a key it was read from), or None if the shapes cannot tell."""
    if field.shape is not None:
        template, axis = field.shape
        found = {name: shape[axis] for name, _, shape in shapes.instances(template)}
        if not found:
            return None
        name = next(iter(found))
        for other, size in found.items():
            if size != found[name]:
                raise ExportError(
                    f"weights disagree on {field.name}: {name} has {found[name]} along axis "
                    f"{axis}, {other} has {size}",
                    key=other,
                )
        return found[name], f"{name} (axis {axis})", name
    if field.count is not None:
        return count(field, shapes)
    return None


def count(field: Field, shapes: Shapes) -> tuple[int, str, str] | None:
    """How many consecutive values a slot takes (per value of the other slots)."""
    if field.count is None:
        return None
    template, slot = field.count
    groups: dict[tuple, set[int]] = {}
    for _, slots, _ in shapes.instances(template):
        rest = tuple(sorted((k, v) for k, v in slots.items() if k != slot))
        groups.setdefault(rest, set()).add(slots[slot])
    if not groups:
        return None
    sizes = set()
    for rest, values in groups.items():
        absent = sorted(set(range(max(values) + 1)) - values)
        if absent:
            where = template.format(**dict(rest), **{slot: absent[0]})
            raise ExportError(f"{field.name}: the weights have no {where}", key=where)
        sizes.add(len(values))
    if len(sizes) > 1:
        raise ExportError(f"weights disagree on {field.name}: {sorted(sizes)} {slot}s per group")
    size = sizes.pop()
    return size, f"{size} {slot}s of {template}", template


# --- checks shared by the architectures (fill derived values into ``cfg``) --------------------

Check = Callable[[str, dict, Shapes], None]
Q_PROJ = "model.layers.{layer}.self_attn.q_proj.weight"
K_PROJ = "model.layers.{layer}.self_attn.k_proj.weight"


def attention(head_dim_default: Callable[[int, int], int], *, rope_pairs: bool) -> Check:
    """Heads and head size against q/k_proj. ``head_dim_default(hidden, heads)`` is what
    transformers uses when the config has no head_dim; ``rope_pairs``: head_dim must be even."""

    def check(arch: str, cfg: dict, shapes: Shapes) -> None:
        q, k = shapes.first(Q_PROJ), shapes.first(K_PROJ)
        if q is None or k is None:
            raise ExportError(f"no {Q_PROJ if q is None else K_PROJ} among the weights")
        (q_name, (q_rows, hidden)), (k_name, (k_rows, _)) = q, k
        heads = cfg.get("num_attention_heads")
        if heads is None:
            raise missing(arch, "num_attention_heads", "attention heads per layer")
        head_dim = cfg.get("head_dim") or head_dim_default(hidden, heads)
        source = "head_dim" if cfg.get("head_dim") else "the default head_dim"
        if heads * head_dim != q_rows:
            raise ExportError(
                f"hf_config num_attention_heads={heads} does not fit {q_name} of shape "
                f"[{q_rows}, {hidden}]: {heads} heads x {head_dim} ({source}) != {q_rows} rows",
                key=q_name,
            )
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None and k_rows != q_rows:
            hint = f" ({k_name} has {k_rows} rows: {k_rows / head_dim:g} heads of {head_dim})"
            raise missing(arch, "num_key_value_heads", "key/value heads per layer", hint)
        kv_heads = heads if kv_heads is None else kv_heads
        if kv_heads * head_dim != k_rows or heads % kv_heads:
            raise ExportError(
                f"hf_config num_key_value_heads={kv_heads} does not fit {k_name} with "
                f"{k_rows} rows and head_dim {head_dim} (or does not divide "
                f"num_attention_heads={heads})",
                key=k_name,
            )
        if rope_pairs and head_dim % 2:
            raise ExportError(f"head_dim {head_dim} is odd: RoPE rotates pairs", key=q_name)
        cfg.update(head_dim=head_dim, num_key_value_heads=kv_heads)

    return check


def sparse_layers(expert_template: str, experts: Field) -> Check:
    """Which layers are MoE (``mlp_only_layers``, ``decoder_sparse_step``) against the weights."""

    def check(arch: str, cfg: dict, shapes: Shapes) -> None:
        sparse = {slots["layer"] for _, slots, _ in shapes.instances(expert_template)}
        layers = cfg["num_hidden_layers"]
        _, n_experts = lookup(cfg, experts)
        step, only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers")
        if only is None:
            only = sorted(set(range(layers)) - sparse)
            cfg["mlp_only_layers"] = only
        expected = {i for i in range(layers) if i not in only and n_experts and (i + 1) % step == 0}
        if expected != sparse:
            raise ExportError(
                f"hf_config mlp_only_layers={only} / decoder_sparse_step={step} make layers "
                f"{sorted(expected)} MoE, but the weights have experts in layers {sorted(sparse)}"
            )

    return check
