"""Exports to an s3://, gs:// or hf:// URL: written and checked in a local temporary folder,
then uploaded one object per file.

Each object appears only when its upload is complete (S3 and GCS uploads, single or
multipart, and Hub commits are atomic), and the index (or the single file) is uploaded
last, so a reader that finds it finds every shard. Nothing is uploaded when any target
object exists and ``overwrite`` is False; a failed upload removes what it had uploaded.
The temporary folder lives in the system's temp directory (``TMPDIR``): it needs room for
the whole export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from inspector.errors import ExportError, InspectorError, output_exists
from inspector.exporting.plan import INDEX_NAME
from inspector.formats.dcp.writer import METADATA_FILE
from inspector.storage.remote import RemoteStorage, display_url

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.base import ExportResult
    from inspector.exporting.request import ExportRequest

# A target URL ending so names one output file; any other names a folder.
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# What an export into a folder may write, checked before anything is written.
LIKELY_NAMES = ("model.safetensors", INDEX_NAME)


def export_to_url(
    request: ExportRequest, write: Callable[[ExportRequest], ExportResult]
) -> ExportResult:
    """``write`` the request into a temporary folder, then upload what it wrote to its URL."""
    ck, overwrite = request.open(), request.overwrite
    options = request.target_options
    if options is None:
        options = request.storage_options
    target = RemoteStorage(str(request.target).rstrip("/"), options)
    single = PurePosixPath(target.basename).suffix in FILE_SUFFIXES
    folder = target.parent() if single else target
    _refuse_inside_source(ck, target.location, [folder.describe(n) for n in LIKELY_NAMES])
    with tempfile.TemporaryDirectory(prefix="inspector-export-") as tmp:
        local = Path(tmp) / target.basename
        result = write(request.locally(ck, local))
        root = local.parent if single else local
        written = [Path(p) for p in result.files]
        index = Path(result.index) if result.index is not None else None
        last = [p for p in written if p.name == METADATA_FILE]  # a DCP folder's index
        first = [p for p in written if p.name != METADATA_FILE]
        order = [*first, *last, *([index] if index is not None else [])]
        names = [p.relative_to(root).as_posix() for p in order]
        _refuse_inside_source(ck, target.location, [folder.describe(name) for name in names])
        if not overwrite:
            for name in names:
                if folder.exists(name):
                    raise output_exists(folder.describe(name))
        urls = _upload(folder, order, names, overwrite)
    return dataclasses.replace(
        result,
        files=list(urls[: len(written)]),
        index=urls[-1] if index is not None else None,
    )


def _upload(
    folder: RemoteStorage, files: list[Path], names: list[str], overwrite: bool
) -> list[str]:
    """Upload in order; on a failure remove the objects uploaded so far, then raise."""
    done: list[str] = []
    try:
        for path, name in zip(files, names, strict=True):
            folder.upload(path, name, overwrite=overwrite)
            done.append(name)
    except BaseException:
        for name in done:
            with contextlib.suppress(InspectorError):
                folder.remove(name)
        raise
    return [folder.describe(name) for name in names]


def _refuse_inside_source(ck: Checkpoint, target: str, objects: list[str]) -> None:
    """Never write into a remote checkpoint folder, nor over (or beside the shards of) a
    file the checkpoint is made of: the rules of a local export."""
    if ck.is_local:
        return
    location = display_url(ck.location).rstrip("/")
    if not ck.source.name and (target == location or target.startswith(location + "/")):
        raise ExportError("output would be written inside the source checkpoint", file=target)
    files = {ck.source.storage.describe(name) for name in ck.source_files} | {location}
    shards = any(f.rsplit("/", 1) == [target, f.rsplit("/", 1)[-1]]
                 and f.rsplit("/", 1)[-1].startswith("model-") for f in files)
    if files & {target, *objects} or shards:
        raise ExportError("output would overwrite a file of the source checkpoint", file=target)
