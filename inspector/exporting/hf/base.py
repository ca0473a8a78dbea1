"""Declarative architecture adapters: name rules torchtitan <-> HF, and plans that say, per
output tensor, which ONE source tensor it comes from and how (so an exporter can stream)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, NamedTuple

from inspector import dtypes
from inspector.errors import ExportError
from inspector.exporting.hf import transforms
from inspector.exporting.hf.config import Check, Field, Shapes, resolve
from inspector.exporting.hf.names import abstract, slot_values, template_form
from inspector.keys.generations import GENERATIONS, NEWEST, respell

if TYPE_CHECKING:
    import torch

NAMINGS = GENERATIONS
COMPONENTS = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
LEGACY_PREFIX = "model."
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
REQUIRED = (EMBED, "model.norm.weight")

COPY, ROPE_Q, ROPE_K, EXPERTS = "copy", "rope_q", "rope_k", "experts"


class TensorMeta(NamedTuple):
    """A tensor's shape and dtype name (:mod:`inspector.dtypes`), so planning needs no torch."""

    shape: tuple[int, ...]
    dtype: str


def tensor_meta(value: Any) -> TensorMeta:
    """Shape and dtype name of a tensor, a ``(shape, dtype)`` pair (a ``torch.dtype`` or its
    name) or DCP's TensorStorageMetadata."""
    if hasattr(value, "properties") and hasattr(value, "size"):
        return TensorMeta(tuple(value.size), dtypes.name_of(value.properties.dtype))
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return TensorMeta(tuple(value.shape), dtypes.name_of(value.dtype))
    shape, dtype = value
    return TensorMeta(tuple(shape), dtypes.name_of(dtype))


@dataclass(frozen=True)
class Rule:
    """One weight under its HF name and its torchtitan 0.3 name (``{layer}``/``{expert}``
    slots); the July-2025 name follows from :mod:`inspector.keys.generations`.

    A rule with one side None maps a key that is not written (``note`` says why). ``kind``:
    COPY, ROPE_Q / ROPE_K (RoPE row permutation), EXPERTS (stacked on the torchtitan side,
    one per expert in HF).
    """

    hf: str | None
    titan: str | None
    kind: str = COPY
    note: str = ""

    def name(self, side: str) -> str | None:
        if side == "hf" or self.titan is None:
            return self.hf if side == "hf" else None
        return respell(self.titan, NEWEST, side)


@dataclass(frozen=True)
class Fill:
    """A torchtitan tensor HF has no counterpart of, written by ``from_hf`` with the value
    torchtitan initialises it to: ``make(source)`` for each HF key matching ``source``
    (its slots fill ``titan``'s), e.g. a zero routing bias per router gate."""

    titan: str
    source: str
    make: Callable[[torch.Tensor], torch.Tensor]
    dtype: str
    note: str


@dataclass(frozen=True)
class Output:
    """One tensor to write: ``transform(read(source))`` has ``shape`` and ``dtype`` (a name).

    ``offsets``/``full_shape`` are set when the output is a piece of the tensor ``name``
    (an HF expert written into torchtitan's stacked experts, e.g. as one DCP chunk).
    ``index``: the transform gets only this slice of the source's leading axis (one layer
    of Megatron's stacked layers), so the whole stack is never read at once.
    """

    name: str
    source: str
    transform: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...] | None = None
    full_shape: tuple[int, ...] | None = None
    index: int | None = None


@dataclass(frozen=True)
class Plan:
    """Everything an exporter needs: outputs in write order, the keys it leaves out (and
    why), the checked HF config to write, notes about fields transformers will default, and
    ``must_equal``: source key pairs the export assumes equal (a tied head left out), which
    the exporter should compare before it trusts the result."""

    arch: str
    direction: str
    naming: str
    outputs: tuple[Output, ...]
    left_out: dict[str, str]
    config: dict
    notes: tuple[str, ...] = ()
    reason: str = ""
    must_equal: tuple[tuple[str, str], ...] = ()

    def tensors(self) -> dict[str, TensorMeta]:
        """Each written tensor's full shape and dtype (pieces counted once)."""
        return {o.name: TensorMeta(o.full_shape or o.shape, o.dtype) for o in self.outputs}


@dataclass(frozen=True)
class Architecture:
    """A model family: its HF identity, name rules, config fields and checks.

    ``markers``: HF names one of whose instances must exist for ``arch="auto"`` to pick it.
    ``fills``: torchtitan tensors written with their initial value by ``from_hf``.
    """

    name: str
    model_type: str
    architectures: tuple[str, ...]
    rules: tuple[Rule, ...]
    fields: tuple[Field, ...]
    checks: tuple[Check, ...] = ()
    markers: tuple[str, ...] = ()
    fills: tuple[Fill, ...] = ()

    def match(self, key: str, side: str) -> tuple[Rule, dict[str, int]] | None:
        """The rule whose ``side`` name (``"hf"`` or a naming) matches ``key``, with its slots."""
        found = self._index[side].get(abstract(key))
        if found is None:
            return None
        rule, slots = found
        return rule, slot_values(key, slots)

    def rule_for(self, key: str, side: str) -> tuple[Rule, dict[str, int]]:
        """:meth:`match` for a key known to match (checked before planning)."""
        found = self.match(key, side)
        if found is None:
            raise ExportError(f"no {self.name} rule names this key ({side} names)", key=key)
        return found

    @cached_property
    def _index(self) -> dict[str, dict[str, tuple[Rule, tuple[str, ...]]]]:
        """Per side: the rule's name with every slot as ``{}`` -> (rule, slot names in order)."""
        index: dict[str, dict[str, tuple[Rule, tuple[str, ...]]]] = {}
        for side in ("hf", *NAMINGS):
            table = index[side] = {}
            for rule in self.rules:
                template = rule.name(side)
                if template:
                    form, slots = template_form(template)
                    table[form] = (rule, slots)
        return index

    def to_hf(
        self, tensors: Mapping[str, Any], config: Mapping | None, naming: str | None = None
    ) -> Plan:
        """Plan torchtitan weights (``{key: tensor meta}``, any layout) -> HF names."""
        return plan_to_hf(self, tensors, config, naming)

    def from_hf(
        self, tensors: Mapping[str, Any], config: Mapping | None, naming: str = "torchtitan"
    ) -> Plan:
        """Plan HF weights -> torchtitan names of ``naming`` (stacked experts as pieces)."""
        return plan_from_hf(self, tensors, config, naming)

    def configure(self, config: Mapping | None, shapes: Shapes) -> tuple[dict, list[str]]:
        """``config`` checked against HF-named ``shapes`` and completed."""
        for name in REQUIRED:
            if name not in shapes:
                raise ExportError(f"the weights have no {name} (HF name): not a whole {self.name}")
        cfg, notes = resolve(self.name, self.model_type, self.fields, config, shapes)
        for check in self.checks:
            check(self.name, cfg, shapes)
        cfg.update(model_type=self.model_type, architectures=list(self.architectures))
        return cfg, notes


def model_keys(keys: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(model keys, left-out key -> why): entries (values with a ``component``) of other
    components than ``"model"`` are set aside (optimizer, RNG, scheduler of any producer);
    for plain metas, torchtitan's component prefixes say it."""
    left_out, model = {}, []
    for key, value in keys.items():
        component = getattr(value, "component", None)
        if component is None:
            prefix = next((c for c in COMPONENTS if key.startswith(c)), None)
            component = prefix[:-1] if prefix else "model"
        if component == "model":
            model.append(key)
        else:
            left_out[key] = f"{component} state, not a model weight"
    return model, left_out


def layouts(keys: list[str]) -> list[dict[str, str]]:
    """Ways to read ``keys`` as model FQNs (-> checkpoint key): as they are and, when all
    carry it, without the ``model.`` prefix of full checkpoints before torchtitan PR #1347."""
    found = [{k: k for k in keys}]
    if keys and all(k.startswith(LEGACY_PREFIX) for k in keys):
        found.append({k[len(LEGACY_PREFIX) :]: k for k in keys})
    return found


def unmatched(arch: Architecture, keys: Mapping[str, str], side: str) -> list[str]:
    index = arch._index[side]
    return [key for key in keys if abstract(key) not in index]


def read_titan(
    arch: Architecture, keys: list[str], naming: str | None
) -> tuple[str, dict[str, str]]:
    """(naming, model FQN -> checkpoint key): the generation and layout whose names cover
    ``keys``; an error lists what no rule covers."""
    namings = list(NAMINGS) if naming is None else [naming]
    if naming is not None and naming not in NAMINGS:
        raise ExportError(f"naming {naming!r} is not one of {sorted(NAMINGS)}")
    tries = [(unmatched(arch, m, n), n, m) for m in layouts(keys) for n in namings]
    misses, naming, mapping = min(tries, key=lambda t: len(t[0]))
    if misses:
        shown = ", ".join(repr(mapping[k]) for k in misses[:3])
        raise ExportError(
            f"{len(misses)} keys have no {arch.name} rule in {NAMINGS[naming]}"
            f"{'' if len(namings) == 1 else ' (nor in the other generation)'}, e.g. {shown}; "
            f"is arch={arch.name!r} right?"
        )
    return naming, mapping


def plan_to_hf(
    arch: Architecture, tensors: Mapping[str, Any], config: Mapping | None, naming: str | None
) -> Plan:
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    model, left_out = model_keys(metas)
    naming, keys = read_titan(arch, model, naming)
    pending: list[tuple[str, str, str, tuple[int, ...], Any, int | None]] = []
    for key, src in keys.items():
        rule, slots = arch.rule_for(key, naming)
        if rule.hf is None:
            left_out[src] = rule.note
            continue
        meta = metas[src]
        if rule.kind == EXPERTS:
            if len(meta.shape) != 3:
                raise ExportError(f"stacked experts must be 3-D, not {list(meta.shape)}", key=src)
            for e in range(meta.shape[0]):
                name = rule.hf.format(**slots, expert=e)
                pending.append((name, src, rule.kind, meta.shape[1:], meta.dtype, e))
        else:
            pending.append((rule.hf.format(**slots), src, rule.kind, meta.shape, meta.dtype, None))
    cfg, notes = arch.configure(config, Shapes({p[0]: p[3] for p in pending}))
    tie = tied(cfg, has_head=any(p[0] == LM_HEAD for p in pending))
    outputs, same = [], []
    embed = next(p[1] for p in pending if p[0] == EMBED)
    for name, src, kind, shape, dtype, index in pending:
        if tie and name == LM_HEAD:
            left_out[src] = f"tied: HF reads lm_head from {EMBED} (tie_word_embeddings is true)"
            same.append((src, embed))
            continue
        outputs.append(Output(name, src, to_hf_transform(kind, cfg, index), shape, dtype))
    return Plan(
        arch.name,
        "to_hf",
        naming,
        tuple(outputs),
        left_out,
        cfg,
        tuple(notes),
        must_equal=tuple(same),
    )


def plan_identity(arch: Architecture, tensors: Mapping[str, Any], config: Mapping | None) -> Plan:
    """Weights that already have HF names (a transformers model trained by DeepSpeed, the
    Trainer, accelerate) written under the same names, unchanged; the config is checked
    against them and a tied ``lm_head`` is left out, as transformers saves it."""
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    model, left_out = model_keys(tensors)
    kept = []
    for key in model:
        rule, _ = arch.rule_for(key, "hf")
        if rule.titan is None:
            left_out[key] = rule.note
        else:
            kept.append(key)
    cfg, notes = arch.configure(config, Shapes({k: metas[k].shape for k in kept}))
    tie = tied(cfg, has_head=LM_HEAD in kept)
    outputs, same = [], []
    for key in kept:
        if tie and key == LM_HEAD:
            left_out[key] = f"tied: HF reads lm_head from {EMBED} (tie_word_embeddings is true)"
            same.append((key, EMBED))
        else:
            outputs.append(Output(key, key, transforms.copy, *metas[key]))
    return Plan(
        arch.name,
        "to_hf",
        "hf",
        tuple(outputs),
        left_out,
        cfg,
        tuple(notes),
        must_equal=tuple(same),
    )


def plan_from_hf(
    arch: Architecture, tensors: Mapping[str, Any], config: Mapping | None, naming: str
) -> Plan:
    if naming not in NAMINGS:
        raise ExportError(f"naming {naming!r} is not one of {sorted(NAMINGS)}")
    metas = {k: tensor_meta(v) for k, v in tensors.items()}
    misses = unmatched(arch, {k: k for k in metas}, "hf")
    if misses:
        shown = ", ".join(repr(k) for k in misses[:3])
        raise ExportError(f"{len(misses)} keys have no {arch.name} HF rule, e.g. {shown}")
    matched = {key: arch.rule_for(key, "hf") for key in metas}
    shapes = Shapes({k: metas[k].shape for k, (rule, _) in matched.items() if rule.titan})
    cfg, notes = arch.configure(config, shapes)
    tie = tied(cfg, has_head=LM_HEAD in metas)
    n_experts = Counter(
        (rule.hf, slots["layer"]) for rule, slots in matched.values() if rule.kind == EXPERTS
    )
    outputs, left_out = [], {}
    for key, (rule, slots) in matched.items():
        target, meta = rule.name(naming), metas[key]
        if target is None:
            left_out[key] = rule.note
        elif rule.kind == EXPERTS:
            total = (n_experts[rule.hf, slots["layer"]], *meta.shape)
            offsets = (slots["expert"],) + (0,) * len(meta.shape)
            piece = Output(
                target.format(**slots),
                key,
                transforms.expert_piece,
                (1, *meta.shape),
                meta.dtype,
                offsets,
                total,
            )
            outputs.append(piece)
        else:
            transform = from_hf_transform(rule.kind, cfg)
            outputs.append(Output(target.format(**slots), key, transform, meta.shape, meta.dtype))
    if tie and LM_HEAD not in metas:
        head = arch.rule_for(LM_HEAD, "hf")[0].name(naming) or LM_HEAD
        outputs.append(Output(head, EMBED, transforms.copy, *metas[EMBED]))
    for fill in arch.fills:
        found = filled(fill, metas, naming)
        outputs += found
        if found:
            notes.append(f"wrote {respell(fill.titan, NEWEST, naming)} x{len(found)}: {fill.note}")
    return Plan(arch.name, "from_hf", naming, tuple(outputs), left_out, cfg, tuple(notes))


def filled(fill: Fill, metas: Mapping[str, TensorMeta], naming: str) -> list[Output]:
    """The outputs of ``fill``: one per HF key matching its source."""
    import torch

    form, slots = template_form(fill.source)
    target = respell(fill.titan, NEWEST, naming)
    found = []
    for key, meta in metas.items():
        if abstract(key) == form:
            shape = tuple(fill.make(torch.empty(meta.shape, device="meta")).shape)
            name = target.format(**slot_values(key, slots))
            found.append(Output(name, key, fill.make, shape, fill.dtype))
    return found


def tied(cfg: dict, *, has_head: bool) -> bool:
    """Whether lm_head is the embedding (absent from the config: iff there is no lm_head)."""
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = not has_head
    if not tie and not has_head:
        raise ExportError(
            "hf_config tie_word_embeddings is false, but the weights have no lm_head "
            "(torchtitan output.weight / lm_head.weight) of their own: set it to true"
        )
    cfg["tie_word_embeddings"] = bool(tie)
    return bool(tie)


def to_hf_transform(kind: str, cfg: dict, index: int | None) -> Callable:
    if kind == ROPE_Q:
        return partial(transforms.rope_to_hf, heads=cfg["num_attention_heads"])
    if kind == ROPE_K:
        return partial(transforms.rope_to_hf, heads=cfg["num_key_value_heads"])
    if kind == EXPERTS and index is not None:
        return partial(transforms.expert, index=index)
    return transforms.copy


def from_hf_transform(kind: str, cfg: dict) -> Callable:
    if kind == ROPE_Q:
        return partial(transforms.rope_from_hf, heads=cfg["num_attention_heads"])
    if kind == ROPE_K:
        return partial(transforms.rope_from_hf, heads=cfg["num_key_value_heads"])
    return transforms.copy
