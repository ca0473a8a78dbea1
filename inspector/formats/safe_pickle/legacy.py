"""Files torch.save wrote before 1.6: five pickles, then each storage's bytes."""

from __future__ import annotations

from typing import Any

from inspector.errors import (
    CorruptCheckpointError,
    UnsupportedError,
)
from inspector.formats.safe_pickle.records import StorageRef
from inspector.formats.safe_pickle.unpickler import DataUnpickler, run
from inspector.reprs import bounded_repr
from inspector.storage.base import Stream

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def load_legacy_torch(f: Stream, *, file: str) -> tuple[Any, list[StorageRef]]:
    """Decode a pre-1.6 (non-zip) torch.save file's pickles, leaving ``f`` at its first storage.

    The file holds five pickles (magic number, format version, system info, the object,
    the storage keys) and then each storage's bytes; returns the object and the storages
    in file order.
    """
    if run(DataUnpickler(f, file, None)) != _LEGACY_MAGIC:
        raise CorruptCheckpointError("a pickle file, but not one torch.save wrote", file=file)
    version, sys_info = (run(DataUnpickler(f, file, None)) for _ in range(2))
    if version != _LEGACY_PROTOCOL:
        raise UnsupportedError(
            f"legacy torch.save format version {bounded_repr(version, 200)}", file=file
        )
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise UnsupportedError("legacy torch.save file from a big-endian machine", file=file)
    unpickler = DataUnpickler(f, file, None)
    value = run(unpickler)
    keys = run(DataUnpickler(f, file, None))
    if not isinstance(keys, list) or not all(k in unpickler.storages for k in keys):
        raise CorruptCheckpointError(
            "legacy torch.save storage list does not match the object's storages", file=file
        )
    return value, [unpickler.storages[k] for k in keys]
