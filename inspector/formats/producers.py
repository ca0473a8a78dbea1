"""The programs that write checkpoints: one small profile each, defined here once.

A profile says how its producer is recognised (files beside the weights, key paths: evidence,
never a guess from names alone), which components a full checkpoint of it holds, which of
them a resume loads, what its prefixes mean, what each layout means for its own loader, and
its run-folder rule (``step-N/``, ``iter_NNNNNNN/`` + tracker, ``global_stepN/`` + ``latest``,
``checkpoint-N/``). Formats name the producer (``Source.producer``) with :func:`identify`;
the layers above read the profile (:func:`profile`) and never test a producer's name.

A new producer is one ``Producer(...)`` record below and one entry in ``PROFILES``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

Path = tuple[object, ...]


@dataclass(frozen=True)
class LayoutNote:
    """What a layout means for the producer's own loader, whether that loader takes it as
    it is (``fine``) or reports keys missing, and what the producer calls it (``called``)."""

    consequence: str
    fine: bool = True
    called: str | None = None


@dataclass(frozen=True)
class StepFiles:
    """A run folder saved one file per step (Lightning's ``ModelCheckpoint``): which files are
    steps (``files``, a glob), the step number in a name (``number``, a regex searched in it,
    its group the number), else the stored key holding it (``counter``), and the name of the
    file that repeats the newest step (``last``, a regex) rather than being one of its own."""

    files: str
    number: str
    counter: str
    last: str


@dataclass(frozen=True)
class Producer:
    """One producer's profile.

    - ``name``: what ``ck.producer`` says; ``title``: how its users call it.
    - Evidence: ``files`` (name patterns, ``/`` at the end for a folder) found in the
      checkpoint's folder, ``keys`` (nested-path patterns, one ``fnmatch`` pattern per
      element, the first one literal, matching a stored path's first elements); any one of
      them names it.
      ``evidence`` says the same in words (notes, README).
    - ``components``: what a full checkpoint of it holds (empty: unknown); ``resume``: which
      of them a resume loads; ``strict``: whether a missing one is an error (the producer
      always writes it) or only a note (its rules are not known). ``step_state``: the
      component whose ``step`` says where the run continues, when it keeps one.
    - Optimizer keys: ``state_first`` when the state's name comes before the parameter's
      FQN (Megatron: ``optimizer.state.exp_avg.<fqn>``); ``param_states``: the states every
      trained parameter has (None: judged from the names seen, Adam's three when present);
      ``common_optimizer``: the key of the object entry whose ``["optimizer"]`` keeps the
      optimizer's ``param_groups`` (lr, betas, eps) and step (``state.common_step``, or each
      group's), where the per-parameter entries keep only the moments (Megatron's common
      state; its distributed optimizer nests them under a second ``["optimizer"]``).
    - ``component_files``: file patterns of a folder saved one file per component (HF
      Trainer, accelerate) -> the component each holds.
    - ``prefixes``: nested-path heads -> what they mean for this producer; ``layouts``:
      layout name -> what it means for its loader.
    - Run folders: ``step_dir`` (a regex whose group is the step number) and ``tracker``
      (the file naming the latest step, and the folder its value names: ``{}``); or
      ``step_files`` when each step is one file.
    """

    name: str
    title: str
    evidence: str
    files: tuple[str, ...] = ()
    keys: tuple[tuple[str, ...], ...] = ()
    components: tuple[str, ...] = ()
    resume: tuple[str, ...] = ("optimizer",)
    strict: bool = True
    step_state: str | None = None
    state_first: bool = False
    param_states: frozenset[str] | None = None
    common_optimizer: str | None = None
    component_files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    prefixes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    layouts: Mapping[str, LayoutNote] = field(default_factory=lambda: MappingProxyType({}))
    step_dir: str | None = None
    tracker: tuple[str, str] | None = None
    step_files: StepFiles | None = None

    def found_in(self, files: Iterable[str], paths: Iterable[Path]) -> str | None:
        """The first piece of evidence for this producer among the folder's ``files``
        (folders end in ``/``) and the stored nested ``paths``; None when there is none."""
        for name in files:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.files):
                return f"{name} (written by {self.title})"
        if self.keys:
            for path in paths:
                for pattern in self.keys:
                    if _starts(path, pattern):
                        shown = ".".join(str(p) for p in path[: len(pattern)])
                        return f"key {shown!r} (written by {self.title})"
        return None


def _starts(path: Path, pattern: tuple[str, ...]) -> bool:
    return len(path) >= len(pattern) and all(
        fnmatch.fnmatchcase(str(part), want) for part, want in zip(path, pattern, strict=False)
    )


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


_LEGACY_PREFIX = (
    "torchtitan stored model weights under 'model.' before PR #1347 (July 2025) "
    "and at top level since"
)
TORCHTITAN = Producer(
    "torchtitan",
    "torchtitan",
    "a DCP folder with torchtitan's training state: dataloader.dp_rank_<r> entries or "
    "train_state.ntokens_seen",
    keys=(("dataloader", "dp_rank_*"), ("train_state", "ntokens_seen")),
    components=("model", "optimizer", "lr_scheduler", "dataloader", "train_state"),
    resume=("optimizer", "lr_scheduler", "dataloader", "train_state"),
    step_state="train_state",
    prefixes=_frozen({"model": _LEGACY_PREFIX}),
    layouts=_frozen(
        {
            "flat": LayoutNote(
                "Loads into current torchtitan as it is.", called="torchtitan's current layout"
            ),
            "prefixed": LayoutNote(
                "Current torchtitan (since PR #1347, July 2025) loads model weights from "
                "top-level keys: loading this checkpoint reports every model key missing",
                fine=False,
            ),
        }
    ),
    step_dir=r"step-([0-9]+)",
)
TORCH_DCP = Producer(
    "torch-dcp",
    "torch.distributed.checkpoint",
    "a DCP folder (.metadata) with no other producer's evidence",
    strict=False,
    prefixes=_frozen(
        {"model": "saved as dcp.save({'model': ...}): dcp.load needs the same nesting"}
    ),
    layouts=_frozen(
        {
            "flat": LayoutNote("dcp.load loads it into a state dict keyed the same way."),
            "prefixed": LayoutNote(
                "dcp.load loads it into a state dict nested the same way "
                "({'model': model_state_dict, ...})."
            ),
        }
    ),
)
MEGATRON = Producer(
    "megatron-core",
    "Megatron-Core",
    "a DCP folder with Megatron's metadata.json ({'sharded_backend': 'torch_dist'})",
    components=("model", "optimizer", "common", "rng"),
    state_first=True,
    param_states=frozenset({"exp_avg", "exp_avg_sq"}),  # the step is the param group's
    common_optimizer="common_state",
    layouts=_frozen({"flat": LayoutNote("Megatron's dist_checkpointing loads it as it is.")}),
    step_dir=r"iter_([0-9]+)",
    tracker=("latest_checkpointed_iteration.txt", "iter_{:07d}"),
)
TORCH_CHECKPOINTING = Producer(
    "torch_checkpointing",
    "torch_checkpointing",
    "metadata.pkl, or <item>_<rank> files (.pt, raw-bytes .bin, .json) for ranks 0..N-1",
    step_dir=r"step_([0-9]+)",
)
DEEPSPEED = Producer(
    "deepspeed",
    "DeepSpeed",
    "a 'latest' tag file beside global_stepN/ folders of mp_rank_*_model_states.pt and "
    "*_optim_states.pt files",
    files=("mp_rank_*_model_states.pt", "*zero_pp_rank_*_optim_states.pt"),
    components=("model", "optimizer", "lr_scheduler"),
    resume=("optimizer",),
    step_dir=r"global_step([0-9]+)",
    tracker=("latest", "{}"),
)
HF_TRAINER = Producer(
    "hf-trainer",
    "Hugging Face Trainer",
    "trainer_state.json beside the model files of a checkpoint-N/ folder",
    files=("trainer_state.json",),
    components=("model", "optimizer", "lr_scheduler", "rng", "train_state"),
    resume=("optimizer", "lr_scheduler", "train_state"),
    component_files=_frozen(
        {
            "optimizer.pt": "optimizer",
            "optimizer.bin": "optimizer",
            "scheduler.pt": "lr_scheduler",
            "rng_state*.pth": "rng",
            "trainer_state.json": "train_state",
            "scaler.pt": "other",
        }
    ),
    layouts=_frozen(
        {
            "flat": LayoutNote(
                "Trainer(resume_from_checkpoint=...) loads it; the model files alone load "
                "with from_pretrained."
            )
        }
    ),
    step_dir=r"checkpoint-([0-9]+)",
)
LIGHTNING = Producer(
    "lightning",
    "PyTorch Lightning",
    "a .ckpt holding pytorch-lightning_version (with state_dict, optimizer_states, loops)",
    keys=(("pytorch-lightning_version",),),
    components=("model", "optimizer", "lr_scheduler", "loops", "callbacks"),
    resume=("optimizer", "loops"),
    prefixes=_frozen(
        {
            "state_dict": "Lightning saves the LightningModule's state dict under "
            "'state_dict'; LightningModule.load_from_checkpoint and Trainer(ckpt_path=...) "
            "read it there"
        }
    ),
    layouts=_frozen(
        {
            "prefixed": LayoutNote(
                "Lightning's loaders (load_from_checkpoint, Trainer.fit(ckpt_path=...)) take it "
                "as it is; a plain nn.Module needs ckpt['state_dict'] (keys without "
                "'state_dict.')."
            )
        }
    ),
    # ModelCheckpoint's default name is "{epoch}-{step}" (epoch=0-step=10.ckpt); save_last
    # writes last.ckpt (last-v1.ckpt beside an older one) as a copy of the newest step.
    step_files=StepFiles(
        "*.ckpt", r"(?:^|[^A-Za-z0-9_])step=([0-9]+)", "global_step", r"last(?:-v[0-9]+)?\.ckpt"
    ),
)
ACCELERATE = Producer(
    "accelerate",
    "Hugging Face accelerate",
    "an Accelerator.save_state folder: random_states_<r>.pkl beside the model and optimizer "
    "(pytorch_model_fsdp_0/ and optimizer_0/ DCP folders, or model.safetensors / "
    "pytorch_model.bin and optimizer.bin)",
    files=("random_states_*.pkl", "pytorch_model_fsdp_*/", "optimizer_*/"),
    components=("model", "optimizer", "rng"),
    resume=("optimizer",),
    component_files=_frozen(
        {
            "pytorch_model_fsdp_*/": "model",
            "optimizer_*/": "optimizer",
            "optimizer*.bin": "optimizer",
            "scheduler*.bin": "lr_scheduler",
            "random_states_*.pkl": "rng",
            "scaler.pt": "other",
        }
    ),
    prefixes=_frozen(
        {
            "model": "accelerate's save_fsdp_model saves {'model': state_dict}; "
            "load_fsdp_model reads it there"
        }
    ),
    layouts=_frozen(
        {
            "flat": LayoutNote("Accelerator.load_state loads it as it is."),
            "prefixed": LayoutNote("Accelerator.load_state loads it as it is."),
        }
    ),
    step_dir=r"checkpoint_([0-9]+)",
)
UNKNOWN = Producer(
    "unknown",
    "an unknown program",
    "no producer's evidence",
    strict=False,
    layouts=_frozen(
        {
            "prefixed": LayoutNote(
                "The model's weights are nested under their component: load that part "
                "(e.g. ckpt['model']) into the model."
            )
        }
    ),
)

# Most specific first: the first whose evidence is found names the checkpoint.
PROFILES: tuple[Producer, ...] = (
    MEGATRON,
    DEEPSPEED,
    HF_TRAINER,
    ACCELERATE,
    LIGHTNING,
    TORCHTITAN,
    TORCH_CHECKPOINTING,
    TORCH_DCP,
    UNKNOWN,
)
_BY_NAME = {p.name: p for p in PROFILES}
NAMES = tuple(_BY_NAME)


def profile(name: str) -> Producer:
    """The profile ``ck.producer`` names (an unknown name: the unknown producer's)."""
    return _BY_NAME.get(name, UNKNOWN)


def identify(
    files: Iterable[str], paths: Iterable[Path], *, fallback: Producer = UNKNOWN
) -> tuple[Producer, str]:
    """The producer the evidence names, and the evidence (or ``fallback`` and why): ``files``
    are the names in the checkpoint's folder (folders ending in ``/``), ``paths`` the stored
    entries' nested paths."""
    heads = {pattern[0] for candidate in PROFILES for pattern in candidate.keys}
    files = list(files)
    paths = [path for path in paths if path and path[0] in heads]  # key patterns start literal
    for candidate in PROFILES:
        found = candidate.found_in(files, paths)
        if found is not None:
            return candidate, f"producer: {candidate.name}, from {found}"
    return fallback, f"producer: {fallback.name} ({fallback.evidence})"
