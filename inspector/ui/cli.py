"""``ckpt-inspect``: the command-line face of the same core (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import inspector
from inspector.entry import Entry
from inspector.errors import InspectorError
from inspector.exporting.request import OPTION, OPTIONS
from inspector.keys.spellings import VIEWS
from inspector.storage.remote import display_url, is_url
from inspector.ui.views.text import (
    TerminalStream,
    human_bytes,
    shape_text,
    terminal_text,
    value_text,
)

CHECK_HELP = """\
Compare the checkpoint's model keys with a model or another checkpoint, explain the
mismatches and rank the key rewrites (strip/add 'model.', wrapper prefixes such as
'_orig_mod.', an inferred prefix difference) that fix them.

Exit code: 0 when every key, shape and dtype matches as spelled (no rewrite applied),
1 otherwise, 2 when a checkpoint cannot be opened.

--json prints {"checkpoint", "against", "spelling", "partial", "ok", "loadable",
"counts": {"checkpoint", "model", "matched", "missing", "unexpected", "shape_mismatches",
"dtype_mismatches"}, "missing": [key], "unexpected": [key], "shape_mismatches" and
"dtype_mismatches": [{"checkpoint_key", "model_key", "checkpoint", "model"}],
"suggestions": [{"description", "steps", "resolves", "remaining", "shape_mismatches",
"why"}], "after_best": null | {"ok", "counts", "renamed": {checkpoint_key: model_key},
"shape_mismatches", "dtype_mismatches"}, "explanation"}.
"""


AUDIT_HELP = """\
Check that a checkpoint is whole and that training can resume from it: every file the
metadata names is there and long enough, every record's CRC-32 matches its bytes (records
saved with CRCs turned off are reported as unchecked, not damaged), safetensors headers and
shard indexes place every tensor, no save was left unfinished (.distcp files without
.metadata, .metadata.tmp, tmp_* folders), every trained parameter has its optimizer state
shaped like it, and scheduler, dataloader (each data-parallel rank) and train state exist.
--values also reads every floating tensor for NaN / Inf and compares step counters.

Exit code: 0 when no error was found (warnings and notes may remain), 1 when errors were
found (an unfinished save included), 2 when the path cannot be opened as a checkpoint.

--json prints {"checkpoint", "format" (null for an unfinished save), "ok", "counts":
{"error", "warning", "info"}, "checked": null | {"checksums", "values", "files", "records",
"verified", "unchecked", "without_checksum", "bytes_checksummed", "tensors_scanned"},
"problems": [{"key", "file", "kind", "severity", "message"}]}; kinds and severities are
listed in inspector/analysis/findings.py (KINDS).
"""

HEALTH_HELP = """\
What changed between the saved steps of a training run (a folder of step-N/, iter_N/,
checkpoint-N/ ... or one step of it), from the weights and the Adam state: per parameter
and step the L2 norm, RMS, max |w|, NaN/Inf counts, zero fraction, the update ratio
|w_t - w_t-1| / |w_t-1| and the cosine of successive updates, the RMS of exp_avg,
exp_avg_sq and of the effective step lr*m_hat/(sqrt(v_hat)+eps); findings: non-finite
values, norm jumps, update-ratio outliers, frozen parameters, step counters that disagree,
zero second moments, dead rows/columns, outlier channels.

Exit code: 0 when no error-severity finding (warnings may remain), 1 when one exists,
2 when the run cannot be opened.

--json prints {"run", "steps": [{"name", "number"}], "thresholds": {"norm_jump",
"update_outlier", "channel_outlier"}, "ok", "errors", "findings": [{"kind", "severity",
"step", "step_name", "key", "layer", "value", "message"}], "layers": [{"group", "layer",
"step", "step_name", "parameters", "numel", "l2", "rms", "absmax", "nan", "inf",
"zero_fraction", "update_ratio", "update_cosine", "exp_avg_rms", "exp_avg_sq_rms",
"effective_step_rms"}], "parameters": [the same per parameter, plus "key", "update_l2",
"second_moment_zero_fraction", "optimizer_step", "dead_rows", "dead_columns",
"outlier_rows", "outlier_columns", "channel_ratio"]}; null where a value does not apply.
Kinds and severities: inspector/analysis/health.py (KINDS).
"""

FINGERPRINT_HELP = """\
A content hash of the model's tensors (or of the keys matching --keys) that does not
depend on the format, sharding, rank count, key prefix or file layout: a 2-rank DCP save,
its 1-rank re-save, its model.-prefixed twin and its safetensors or .pt export print the
same digest; another dtype, shape or value prints another.

--json prints {"checkpoint", "algorithm", "digest", "duplicates": [name], "tensors":
{canonical name: {"key", "dtype", "shape", "digest"}}}. Exit code 0, or 2 when the
checkpoint (or a tensor) cannot be read.
"""


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def cmd_ls(args: argparse.Namespace) -> int:
    ck = inspector.open(args.path, args.storage_options)
    if not args.no_scan:
        ck.scan(progress=not args.json and sys.stderr.isatty())
    entries = _listed(ck.entries(), args)
    if args.json:
        payload = {
            "path": ck.location,
            "format": ck.format,
            "producer": ck.producer,
            "layout": ck.layout,
            "source_files": list(ck.source_files),
            "notes": list(ck.source.notes),
            "metadata": ck.metadata,
            "entries": [r for r in ck.records() if r["key"] in {e.key for e in entries}],
        }
        json.dump(payload, sys.stdout, indent=1)
        print()
        return 0
    print(f"{ck.location}  format={ck.format}  layout={ck.layout}  keys={len(entries)}")
    facts = [ck.facts(e.key) for e in entries]
    extra = any(f.subclass or f.fp8 for f in facts)
    broken = any(f.error for f in facts)
    header = ["key", "dtype", "shape", "chunks", "size"] + (["subclass", "fp8"] if extra else [])
    rows = []
    for e, f in zip(entries, facts, strict=True):
        row = [e.key, e.dtype or e.kind, shape_text(e), str(len(e.chunks)), human_bytes(e.nbytes)]
        if extra:
            row += [f.subclass or "", f.fp8 or ""]
        rows.append(row + ([f.error or ""] if broken else []))
    _print_table(rows, header + (["error"] if broken else []))
    return 0


def _listed(entries: list[Entry], args: argparse.Namespace) -> list[Entry]:
    """The entries ``ls`` shows: of one component, matching ``--grep``, in ``--sort`` order."""
    if args.component:
        entries = [e for e in entries if e.component == args.component]
    if args.grep:
        pattern = re.compile(args.grep)
        entries = [e for e in entries if pattern.search(e.key)]
    if args.sort == "size":
        entries = sorted(entries, key=lambda e: -e.nbytes)
    elif args.sort == "key":
        entries = sorted(entries, key=lambda e: e.key)
    return entries


def cmd_show(args: argparse.Namespace) -> int:
    ck = inspector.open(args.path, args.storage_options)
    entry = ck.entry(args.key)
    ck.detection(args.key)
    if entry.kind == "object":
        print(f"{entry.key}: object ({entry.component})")
        print(value_text(ck.read_object(args.key)))
        return 0
    tensor = ck.read(args.key)
    facts = ck.facts(args.key)
    print(f"{entry.key}: tensor ({entry.component})")
    print(f"  dtype    {entry.dtype}")
    size = human_bytes(entry.nbytes)
    print(f"  shape    {list(entry.shape or ())}  ({entry.numel} elements, {size})")
    print(f"  chunks   {len(entry.chunks)} in {', '.join(entry.files)}")
    for chunk in entry.chunks[: args.chunks]:
        print(
            f"           offsets {list(chunk.offsets)} sizes {list(chunk.sizes)} "
            f"{chunk.file}@{chunk.byte_offset}"
        )
    if facts.subclass:
        print(f"  subclass {facts.subclass}")
    if facts.fp8:
        print(f"  fp8      {facts.fp8}")
    flat = tensor.reshape(-1)[: args.values]
    print(f"  values   {_format_values(flat)}{' ...' if tensor.numel() > args.values else ''}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from inspector.analysis.diff import summarize

    table = inspector.diff(
        args.a,
        args.b,
        values=not args.keys_only,
        atol=args.atol,
        rtol=args.rtol,
        key_map=None if args.key_map == "none" else "auto",
        progress=False,
        fingerprints=args.fingerprints,
        storage_options=args.storage_options,
    )
    equal = bool(table["equal"].all())
    summary = summarize(table)
    if args.json:
        rows = json.loads(table.to_json(orient="records"))
        json.dump(
            {
                "a": _shown(args.a),
                "b": _shown(args.b),
                "equal": equal,
                "summary": summary,
                "rows": rows,
            },
            sys.stdout,
            indent=1,
        )
        print()
        return 0 if equal else 1
    print(f"{len(table)} keys: " + ", ".join(f"{n} {s}" for s, n in summary.items() if n))
    differing = table[~table["equal"] | (table["status"] == "dtype")]
    rows = [
        [
            r.key if _missing(r.key_b) or r.key_b == r.key else f"{r.key} -> {r.key_b}",
            r.status,
            f"{_number(r.dtype_a, '{}') or '-'} / {_number(r.dtype_b, '{}') or '-'}",
            _number(r.max_abs_diff, "{:.3g}"),
            _number(r.n_diff, "{:.0f}"),
        ]
        for r in differing.itertuples()
    ]
    if rows:
        _print_table(rows, ["key", "status", "dtype a / b", "max abs diff", "differing"])
    print(
        "equal" if equal else "DIFFERENT",
        "within" if args.atol or args.rtol else "at",
        f"atol={args.atol} rtol={args.rtol}",
    )
    return 0 if equal else 1


def cmd_audit(args: argparse.Namespace) -> int:
    report = inspector.audit(
        args.path,
        checksums=not args.no_checksums,
        values=args.values,
        progress=not args.json and sys.stderr.isatty(),
        storage_options=args.storage_options,
    )
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(report)
    return 0 if report.ok else 1


def cmd_health(args: argparse.Namespace) -> int:
    report = inspector.health(
        args.path,
        steps=args.steps,
        keys=args.keys,
        storage_options=args.storage_options,
        workers=args.workers,
    )
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(report.text())
    return 1 if report.has_errors else 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    found = inspector.fingerprint(
        args.path,
        keys=args.keys,
        progress=not args.json and sys.stderr.isatty(),
        storage_options=args.storage_options,
    )
    if args.json:
        json.dump(found.as_dict(), sys.stdout, indent=1)
        print()
        return 0
    print(found)
    if args.tensors:
        _print_table(
            [
                [p.name, p.dtype, "x".join(map(str, p.shape)) or "()", p.digest]
                for p in found.prints
            ],
            ["name", "dtype", "shape", "digest"],
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    options = {o.name: getattr(args, o.name) for o in OPTIONS}
    result = inspector.export(
        args.path,
        args.out,
        **options | {"dtype": args.dtype or None},
        progress=sys.stderr.isatty(),
        storage_options=args.storage_options,
        target_options=args.target_options,
        distributed=int(os.environ.get("WORLD_SIZE", "1")) > 1,  # under torchrun
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(result.summary())
    return 0 if result.verification is None or result.verification.ok else 1


def _shown(path: str) -> str:
    """A path or URL as it may be printed (a URL without credentials or query string)."""
    return display_url(path) if is_url(path) else path


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` of ``--storage-option``; the value is read as JSON when it is JSON
    (``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``), else taken as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, not {text.partition('=')[0]!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


class _CollectOptions(argparse.Action):
    """Repeated ``KEY=VALUE`` options into one dict (None when none is given)."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        options = dict(getattr(namespace, self.dest) or {})
        options[value[0]] = value[1]
        setattr(namespace, self.dest, options)


def _missing(value: Any) -> bool:
    """None, or the NaN pandas stores in its place."""
    return value is None or (isinstance(value, float) and value != value)


def _number(value: Any, fmt: str) -> str:
    return "" if _missing(value) else fmt.format(value)


def _format_values(flat: Any) -> str:
    if flat.dtype.is_floating_point and flat.dtype.itemsize == 1:
        flat = flat.float()
    return str(flat.tolist())


def cmd_check(args: argparse.Namespace) -> int:
    from inspector.analysis.fqn import resolve_against

    sys.path.insert(0, os.getcwd())  # as with `python -m`: the user's own modules import
    against = resolve_against(args.against, device=args.device)
    report = inspector.check_keys(
        args.path, against, spelling=args.spelling, storage_options=args.storage_options
    )
    passed = report.loadable if args.ignore_dtype else report.ok
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
        return 0 if passed else 1
    print(textwrap.fill(report.explain(), width=100))
    _print_keys("missing from the checkpoint", report.missing, args.limit)
    _print_keys("unexpected in the checkpoint", report.unexpected, args.limit)
    for name, found in (("shape", report.shape_mismatches), ("dtype", report.dtype_mismatches)):
        if found:
            print(f"\n{name} mismatches ({len(found)}):")
            rows = [[m.model_key, str(m.checkpoint), str(m.model)] for m in found[: args.limit]]
            _print_table(rows, ["key", "checkpoint", "model"])
    if report.suggestions:
        print("\nsuggested rewrites of the checkpoint keys, best first:")
        rows = [
            [str(i), s.description, str(s.resolves), str(s.remaining), str(s.shape_mismatches)]
            for i, s in enumerate(report.suggestions, 1)
        ]
        _print_table(rows, ["#", "rewrite", "resolves", "left", "shape mismatches"])
    return 0 if passed else 1


def _print_keys(title: str, keys: list[str], limit: int) -> None:
    if keys:
        print(f"\n{title} ({len(keys)}):")
        for key in keys[:limit]:
            print(f"  {key}")
        if len(keys) > limit:
            print(f"  ... {len(keys) - limit} more")


def _options(dest: str, what: str) -> dict[str, Any]:
    """``add_argument``'s keywords for repeated ``KEY=VALUE`` fsspec options."""
    return {
        "dest": dest,
        "action": _CollectOptions,
        "type": parse_option,
        "default": None,
        "metavar": "KEY=VALUE",
        "help": f"fsspec storage option for {what} (repeatable), e.g. "
        "endpoint_url=http://127.0.0.1:9000 or anon=true",
    }


@dataclass(frozen=True)
class Command:
    """A sub-command: its name, help, the function it runs and its arguments (flag or
    positional name -> ``add_argument`` keywords); ``description`` is shown verbatim."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Mapping[str, Mapping[str, Any]]
    description: str | None = None


JSON = {"--json": {"action": "store_true", "help": "machine-readable output"}}
EVERY_COMMAND = {
    "--storage-option": _options(
        "storage_options", "s3://, gs://, hf://, http(s):// checkpoints"
    )
}
COMMANDS = (
    Command("ls", "list keys with dtype, shape, chunks and size", cmd_ls, {
        "path": {},
        **JSON,
        "--no-scan": {
            "action": "store_true",
            "help": "skip reading each chunk's pickle record (subclass / fp8 columns stay "
            "empty for DCP)",
        },
        "--component": {"metavar": "NAME", "help": "only this component's keys (e.g. model)"},
        "--grep": {"metavar": "REGEX", "help": "only keys this regular expression finds"},
        "--sort": {
            "choices": ("stored", "key", "size"),
            "default": "stored",
            "help": "order: as stored (default), by key, or largest first",
        },
    }),
    Command("show", "one key: summary and first values", cmd_show, {
        "path": {},
        "key": {},
        "--values": {"type": int, "default": 8, "help": "how many values to print"},
        "--chunks": {"type": int, "default": 8, "help": "how many chunks to list"},
    }),
    Command("diff", "compare two checkpoints key by key (exit 0 when equal)", cmd_diff, {
        "a": {},
        "b": {},
        **JSON,
        "--keys-only": {"action": "store_true", "help": "compare keys, dtypes, shapes only"},
        "--atol": {"type": float, "default": 0.0, "help": "absolute tolerance"},
        "--rtol": {"type": float, "default": 0.0, "help": "relative tolerance"},
        "--key-map": {
            "choices": ("auto", "none"),
            "default": "auto",
            "help": "auto: match keys across layouts with the FQN doctor's best rewrite",
        },
        "--fingerprints": {
            "action": "store_true",
            "help": "hash each tensor pair from its stored bytes first; equal ones are not "
            "compared",
        },
    }),
    Command(
        "check",
        "compare the checkpoint's model keys with a model or checkpoint; suggest renames",
        cmd_check,
        {
            "path": {},
            "--against": {
                "required": True,
                "metavar": "OTHER_PATH | module.path:factory",
                "help": "another checkpoint, or a callable that builds the model (called under "
                "--device)",
            },
            **JSON,
            "--spelling": {
                "choices": VIEWS,
                "help": "how to spell the checkpoint's model keys (default: stored for DCP, "
                "else flattened)",
            },
            "--device": {
                "default": "meta",
                "help": "device the factory builds the model on (default: meta)",
            },
            "--ignore-dtype": {
                "action": "store_true",
                "help": "dtype mismatches alone do not fail (exit 0)",
            },
            "--limit": {"type": int, "default": 20, "help": "how many keys to list per group"},
        },
        CHECK_HELP,
    ),
    Command(
        "audit",
        "is the checkpoint whole and resumable? (exit 0 ok, 1 problems, 2 unreadable)",
        cmd_audit,
        {
            "path": {},
            **JSON,
            "--no-checksums": {
                "action": "store_true",
                "help": "skip reading the bytes for CRC-32 checks",
            },
            "--values": {"action": "store_true", "help": "also count NaN / Inf values"},
        },
        AUDIT_HELP,
    ),
    Command(
        "health",
        "what changed between a run's saved steps (exit 1 on error findings)",
        cmd_health,
        {
            "path": {},
            **JSON,
            "--steps": {"nargs": "+", "metavar": "STEP", "help": "saved steps, by name or number"},
            "--keys": {"nargs": "+", "metavar": "GLOB", "help": "model parameters, by name"},
            "--workers": {
                "type": int,
                "default": 1,
                "metavar": "N",
                "help": "processes the parameters are split across (same report as 1)",
            },
        },
        HEALTH_HELP,
    ),
    Command(
        "fingerprint",
        "content hash of the weights, independent of format, sharding and key prefix",
        cmd_fingerprint,
        {
            "path": {},
            **JSON,
            "--keys": {
                "nargs": "+",
                "action": "extend",
                "metavar": "GLOB",
                "help": "stored keys or canonical names, any component (after PATH; repeatable)",
            },
            "--tensors": {"action": "store_true", "help": "also list each tensor's digest"},
        },
        FINGERPRINT_HELP,
    ),
    Command(
        "export",
        "write .safetensors (HF-sharded), .pt, an HF model folder or a DCP folder, streaming",
        cmd_export,
        {
            "path": {},
            "out": {
                "help": "safetensors: a folder (or *.safetensors); pt: the file; hf, dcp: a "
                "folder; or an s3://, gs://, hf:// URL",
            },
            "--target-option": _options(
                "target_options", "a URL output (default: the --storage-option ones)"
            ),
            **{o.flag: o.argument() for o in OPTIONS},
        },
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="ckpt-inspect",
        description="Inspect PyTorch checkpoints (DCP, .pt, safetensors) safely.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        found = sub.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter
            if command.description
            else argparse.HelpFormatter,
        )
        for flag, keywords in {**EVERY_COMMAND, **command.arguments}.items():
            found.add_argument(flag, **keywords)
        found.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout, sys.stdout = sys.stdout, TerminalStream(sys.stdout)
    try:
        return args.func(args)
    except InspectorError as exc:
        print(terminal_text(f"error: {exc.worded(_flag)}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ckpt-inspect ls ... | head` ends quietly
        _silence_stdout()
        return 1
    finally:
        sys.stdout = stdout


def _flag(name: str) -> str:
    """How the command line names an export option in a message: its flag."""
    return OPTION[name].flag if name in OPTION else name


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit does not hit the closed pipe again.
    (Not SIGPIPE's default action: that is process-wide, and would also kill a caller in the
    same process on a socket a server closed.)"""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
