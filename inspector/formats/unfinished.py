"""Signs in a folder that a save did not finish, and what it left there.

DCP writes every ``.distcp`` file first and ``.metadata`` last, under the temporary name
``.metadata.tmp`` until it is complete; without collectives each rank writes its own
``__<rank>.metadata``. torch_checkpointing writes into ``tmp_<name>/`` and commits by
renaming the folder. So ``.distcp`` files without metadata, a ``.metadata.tmp``, a rank's
data without its metadata, or a ``tmp_*`` folder mean an interrupted or still running
(e.g. asynchronous) save. Detection (which cannot open such a folder) and the audit (which
reports it) both use :func:`unfinished_save`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from inspector.errors import InspectorError
from inspector.formats.dcp.reader import METADATA_FILE, RANK_FILE, RANK_METADATA, metadata_files
from inspector.storage.base import Storage

DCP_DATA_SUFFIX = ".distcp"
METADATA_TMP = METADATA_FILE + ".tmp"
TMP_PREFIX = "tmp_"
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class Sign:
    """One sign of an unfinished save: what it means, and the files that show it.

    ``blocking``: the checkpoint in this folder itself did not finish (no complete metadata);
    otherwise it is something left beside it (a later save's ``.metadata.tmp``, a
    ``tmp_*`` folder) that does not stop this checkpoint from opening.
    """

    message: str
    files: tuple[str, ...]
    blocking: bool


def unfinished_save(storage: Storage, *, contents: bool = True) -> list[Sign]:
    """The signs in the folder ``storage`` that a save did not finish (empty: none).
    ``contents=False``: only whether the folder itself is an uncommitted ``tmp_`` folder (for
    one file opened in it, which the rest of the folder does not concern)."""
    signs: list[Sign] = []
    name = PurePosixPath(storage.location.rstrip("/")).name
    if name.startswith(TMP_PREFIX):
        signs.append(
            Sign(
                f"the folder {name}/ was never renamed to {name[len(TMP_PREFIX) :]}/: "
                "torch_checkpointing saves into tmp_<name>/ and renames it when the save commits",
                (),
                True,
            )
        )
    if not contents:
        return signs
    try:
        listed = storage.list()
    except InspectorError:
        return signs
    files = [n for n, kind in listed if kind == "file"]
    folders = [n for n, kind in listed if kind == "dir"]
    signs[:0] = _dcp_signs(storage, files)
    for folder in folders:
        if folder.startswith(TMP_PREFIX):
            signs.append(
                Sign(
                    f"{folder}/ holds a save that never committed (torch_checkpointing renames "
                    f"tmp_<name>/ to <name>/ when a save finishes)",
                    (folder,),
                    False,
                )
            )
    for file in files:
        if file.endswith(TMP_SUFFIX) and file != METADATA_TMP:
            signs.append(
                Sign(f"{file} was written under a temporary name and never renamed", (file,), False)
            )
    return signs


def _dcp_signs(storage: Storage, files: list[str]) -> list[Sign]:
    data = [n for n in files if n.endswith(DCP_DATA_SUFFIX)]
    metadata = metadata_files(storage)
    tmp = METADATA_TMP in files
    if data and not metadata:
        if tmp:
            why = f"{METADATA_TMP} was written but never renamed to {METADATA_FILE}"
        else:
            why = f"{DCP_DATA_SUFFIX} files but no {METADATA_FILE} file, which DCP writes last"
        there = _what_is_there(storage, data)
        shown = (*data, *([METADATA_TMP] * tmp))
        return [Sign(f"the save did not finish: {why} ({there})", shown, True)]
    signs = []
    if tmp:
        signs.append(
            Sign(
                f"{METADATA_TMP} beside {METADATA_FILE}: a later save into this folder did not "
                f"finish, and may have overwritten {DCP_DATA_SUFFIX} files this metadata describes",
                (METADATA_TMP,),
                False,
            )
        )
    if metadata != [METADATA_FILE]:
        described = {m.group(1) for f in metadata if (m := RANK_METADATA.fullmatch(f))}
        lacking = sorted(
            {m.group(1) for f in data if (m := RANK_FILE.fullmatch(f))} - described, key=int
        )
        if lacking:
            orphans = [f for f in data if (m := RANK_FILE.fullmatch(f)) and m.group(1) in lacking]
            signs.append(
                Sign(
                    f"the save did not finish on rank {', '.join(lacking)}: "
                    f"{', '.join(orphans)} but no __{lacking[0]}.metadata (saved without "
                    "collectives, each rank writes its own metadata last)",
                    tuple(orphans),
                    True,
                )
            )
    return signs


def _what_is_there(storage: Storage, data: list[str]) -> str:
    """``"2 .distcp files there: ranks 0-1, 1,944,318 bytes"``."""
    total = 0
    for name in data:
        try:
            total += storage.size(name)
        except InspectorError:
            continue
    ranks = sorted({int(m.group(1)) for n in data if (m := RANK_FILE.fullmatch(n))})
    who = ""
    if len(ranks) == 1:
        who = f"rank {ranks[0]}, "
    elif ranks:
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        who = f"ranks {ranks[0]}-{ranks[-1]}, " if contiguous else f"ranks {ranks}, "
    plural = "s" if len(data) != 1 else ""
    return f"{len(data)} {DCP_DATA_SUFFIX} file{plural} there: {who}{total:,} bytes"
