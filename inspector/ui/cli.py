"""``ckpt-inspect``: the command-line face of the same core (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import inspector
from inspector.errors import InspectorError
from inspector.exporting.fp8 import FP8_MODES
from inspector.exporting.plan import ARCHITECTURE_NAMES, DEFAULT_SHARD_SIZE, EXPORT_FORMATS
from inspector.keys.generations import GENERATIONS
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
    entries = ck.entries()
    if args.json:
        payload = {
            "path": ck.location,
            "format": ck.format,
            "producer": ck.producer,
            "layout": ck.layout,
            "source_files": list(ck.source_files),
            "notes": list(ck.source.notes),
            "metadata": ck.metadata,
            "entries": ck.records(),
        }
        json.dump(payload, sys.stdout, indent=1)
        print()
        return 0
    print(f"{ck.location}  format={ck.format}  layout={ck.layout}  keys={len(entries)}")
    facts = [ck.facts(e.key) for e in entries]
    extra = any(f.subclass or f.fp8 for f in facts)
    header = ["key", "dtype", "shape", "chunks", "size"] + (["subclass", "fp8"] if extra else [])
    rows = []
    for e, f in zip(entries, facts, strict=True):
        row = [e.key, e.dtype or e.kind, shape_text(e), str(len(e.chunks)), human_bytes(e.nbytes)]
        if extra:
            row += [f.subclass or "", f.fp8 or ""]
        if f.error:
            row[0] = f"{e.key}  [unreadable: {f.error}]"
        rows.append(row)
    _print_table(rows, header)
    return 0


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
    result = inspector.export(
        args.path,
        args.out,
        format=args.format,
        dtype=args.dtype or None,
        fp8=args.fp8,
        model_only=not args.all_components,
        flatten=not args.keep_prefix,
        nested=args.nested,
        include=args.include,
        exclude=args.exclude,
        arch=args.arch,
        naming=args.naming,
        hf_config=args.hf_config,
        hf_assets=args.hf_assets,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        on_error="skip" if args.skip_unreadable else "fail",
        progress=sys.stderr.isatty(),
        storage_options=args.storage_options,
        target_options=args.target_options,
        workers=args.workers,
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


def _options_argument(parser: argparse.ArgumentParser, flag: str, dest: str, what: str) -> None:
    parser.add_argument(
        flag,
        dest=dest,
        action=_CollectOptions,
        type=parse_option,
        default=None,
        metavar="KEY=VALUE",
        help=f"fsspec storage option for {what} (repeatable), e.g. "
        "endpoint_url=http://127.0.0.1:9000 or anon=true",
    )


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-inspect",
        description="Inspect PyTorch checkpoints (DCP, .pt, safetensors) safely.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    remote = argparse.ArgumentParser(add_help=False)
    _options_argument(
        remote, "--storage-option", "storage_options", "s3://, gs://, hf://, http(s):// checkpoints"
    )
    ls = sub.add_parser("ls", help="list keys with dtype, shape, chunks and size", parents=[remote])
    ls.add_argument("path")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument(
        "--no-scan",
        action="store_true",
        help="skip reading each chunk's pickle record (subclass / fp8 columns stay empty for DCP)",
    )
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="one key: summary and first values", parents=[remote])
    show.add_argument("path")
    show.add_argument("key")
    show.add_argument("--values", type=int, default=8, help="how many values to print")
    show.add_argument("--chunks", type=int, default=8, help="how many chunks to list")
    show.set_defaults(func=cmd_show)
    diff = sub.add_parser(
        "diff", help="compare two checkpoints key by key (exit 0 when equal)", parents=[remote]
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    diff.add_argument("--keys-only", action="store_true", help="compare keys, dtypes, shapes only")
    diff.add_argument("--atol", type=float, default=0.0, help="absolute tolerance")
    diff.add_argument("--rtol", type=float, default=0.0, help="relative tolerance")
    diff.add_argument(
        "--key-map",
        choices=("auto", "none"),
        default="auto",
        help="auto: match keys across layouts with the FQN doctor's best rewrite",
    )
    diff.add_argument(
        "--fingerprints",
        action="store_true",
        help="hash each tensor pair from its stored bytes first; equal ones are not compared",
    )
    diff.set_defaults(func=cmd_diff)
    check = sub.add_parser(
        "check",
        help="compare the checkpoint's model keys with a model or checkpoint; suggest renames",
        description=CHECK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[remote],
    )
    check.add_argument("path")
    check.add_argument(
        "--against",
        required=True,
        metavar="OTHER_PATH | module.path:factory",
        help="another checkpoint, or a callable that builds the model (called under --device)",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument(
        "--spelling",
        choices=VIEWS,
        help="how to spell the checkpoint's model keys (default: stored for DCP, else flattened)",
    )
    check.add_argument(
        "--device", default="meta", help="device the factory builds the model on (default: meta)"
    )
    check.add_argument(
        "--ignore-dtype", action="store_true", help="dtype mismatches alone do not fail (exit 0)"
    )
    check.add_argument("--limit", type=int, default=20, help="how many keys to list per group")
    check.set_defaults(func=cmd_check)

    aud = sub.add_parser(
        "audit",
        help="is the checkpoint whole and resumable? (exit 0 ok, 1 problems, 2 unreadable)",
        description=AUDIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[remote],
    )
    aud.add_argument("path")
    aud.add_argument("--json", action="store_true", help="machine-readable output")
    aud.add_argument(
        "--no-checksums", action="store_true", help="skip reading the bytes for CRC-32 checks"
    )
    aud.add_argument("--values", action="store_true", help="also count NaN / Inf values")
    aud.set_defaults(func=cmd_audit)
    fpr = sub.add_parser(
        "fingerprint",
        help="content hash of the weights, independent of format, sharding and key prefix",
        description=FINGERPRINT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[remote],
    )
    fpr.add_argument("path")
    fpr.add_argument("--json", action="store_true", help="machine-readable output")
    fpr.add_argument(
        "--keys",
        nargs="+",
        action="extend",
        metavar="GLOB",
        help="stored keys or canonical names, any component (after PATH; repeatable)",
    )
    fpr.add_argument("--tensors", action="store_true", help="also list each tensor's digest")
    fpr.set_defaults(func=cmd_fingerprint)

    exp = sub.add_parser(
        "export",
        help="write .safetensors (HF-sharded), .pt, an HF model folder or a DCP folder, streaming",
        parents=[remote],
    )
    exp.add_argument("path")
    exp.add_argument(
        "out",
        help="safetensors: a folder (or *.safetensors); pt: the file; hf, dcp: a folder; "
        "or an s3://, gs://, hf:// URL",
    )
    _options_argument(
        exp,
        "--target-option",
        "target_options",
        "a URL output (default: the --storage-option ones)",
    )
    exp.add_argument("--format", choices=EXPORT_FORMATS, default=EXPORT_FORMATS[0])
    exp.add_argument("--arch", help="hf, dcp: auto (default) or " + ", ".join(ARCHITECTURE_NAMES))
    exp.add_argument("--hf-assets", metavar="DIR", help="hf: tokenizer, config.json, ... to copy")
    exp.add_argument("--hf-config", metavar="FILE", help="hf, dcp: the config.json to use")
    exp.add_argument(
        "--naming", choices=GENERATIONS, help="dcp: torchtitan (0.3, default) or torchtitan-2025"
    )
    exp.add_argument("--dtype", help="cast floating tensors, e.g. bfloat16")
    exp.add_argument("--fp8", choices=FP8_MODES, default=FP8_MODES[0])
    exp.add_argument(
        "--max-shard-size", default=DEFAULT_SHARD_SIZE, help="e.g. 5GB (decimal), 500MiB"
    )
    exp.add_argument("--keep-prefix", action="store_true", help="keep the 'model.' prefix")
    exp.add_argument("--all-components", action="store_true", help="not only the model")
    exp.add_argument("--nested", action="store_true", help="pt: keep the stored nesting")
    exp.add_argument("--include", action="append", metavar="GLOB", help="keys to keep")
    exp.add_argument("--exclude", action="append", metavar="GLOB", help="keys to leave out")
    exp.add_argument("--overwrite", action="store_true", help="replace existing output")
    exp.add_argument("--no-verify", action="store_true", help="skip re-reading the output")
    exp.add_argument("--skip-unreadable", action="store_true", help="leave damaged keys out")
    exp.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes writing the export (same bytes as 1); under torchrun each rank "
        "writes its share",
    )
    exp.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout, sys.stdout = sys.stdout, TerminalStream(sys.stdout)
    try:
        return args.func(args)
    except InspectorError as exc:
        print(terminal_text(f"error: {exc}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ckpt-inspect ls ... | head` ends quietly
        _silence_stdout()
        return 1
    finally:
        sys.stdout = stdout


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit does not hit the closed pipe again.
    (Not SIGPIPE's default action: that is process-wide, and would also kill a caller in the
    same process on a socket a server closed.)"""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
