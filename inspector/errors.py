"""Errors raised for bad or unsupported input; every message names the file and the key."""

from __future__ import annotations

import os
from collections.abc import Callable


class InspectorError(Exception):
    """Base class: something about a checkpoint (or a request about one) is wrong.

    ``file`` and ``key`` say where; the message repeats them so a printed error is enough.
    """

    def __init__(
        self, message: str, *, file: str | os.PathLike | None = None, key: str | None = None,
        option: tuple[str, str] | None = None,
    ) -> None:
        self.file = None if file is None else str(file)
        self.key = key
        self.option = option
        self.reason = message
        where = [f"{self.file}" if self.file else "", f"key {key!r}" if key is not None else ""]
        prefix = ": ".join(w for w in where if w)
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def __reduce__(self) -> tuple:
        """Pickle by state, so an error raised in a worker process arrives whole (file, key,
        reason and any subclass fields), not re-built from its formatted message."""
        return _restored, (type(self), self.args, self.__dict__.copy())

    def worded(self, spell: Callable[[str], str]) -> str:
        """The message with the option it names (``option``: its name and how the message
        spells it, e.g. ``("overwrite", "overwrite=True")``) spelled by a front end's ``spell``
        (the CLI's flag, the app's label)."""
        if self.option is None:
            return str(self)
        name, spelled = self.option
        return str(self).replace(spelled, spell(name))

    @property
    def located(self) -> str:
        """The reason, after the name of the file it is about (how an entry records it)."""
        return f"{os.path.basename(self.file)}: {self.reason}" if self.file else self.reason


def _restored(cls: type[InspectorError], args: tuple, state: dict) -> InspectorError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class NotACheckpointError(InspectorError):
    """The path is not a checkpoint in any format we know."""


class UnfinishedSaveError(NotACheckpointError):
    """A save that did not finish: some of its files are there, the one that completes it
    (DCP's ``.metadata``, torch_checkpointing's commit rename) is not. ``found`` lists what
    is there."""

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike | None = None,
        key: str | None = None,
        found: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, file=file, key=key)
        self.found = found


class CheckpointFileMissingError(InspectorError):
    """A file the checkpoint refers to (a shard, ``.metadata``) does not exist."""


class CorruptCheckpointError(InspectorError):
    """A file is truncated, inconsistent with its metadata, or not what it claims to be."""


class UnsafeCheckpointError(InspectorError):
    """The checkpoint tries to run code or reach outside its folder; nothing was executed."""


class UnsupportedError(InspectorError):
    """Valid input that this version cannot decode (e.g. an unknown stream transform)."""


class MissingKeyError(InspectorError, KeyError):
    """The checkpoint has no such key."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class UsageError(InspectorError, ValueError):
    """A call's arguments are wrong: an unknown mode, format, dtype name or size."""


class ExportError(InspectorError):
    """An export cannot be done as asked (output exists, unsupported dtype, ...)."""


class StorageAccessError(InspectorError):
    """The storage holding the checkpoint refused or failed a request (access denied, a
    timeout, a server error, a server that ignores byte ranges); the files may be fine."""


class RemoteError(StorageAccessError):
    """A remote server misbehaved: stalled, trickled, sent more than was asked for or an
    encoding that was not asked for. The message names the URL without credentials."""


def output_exists(where: str | os.PathLike) -> ExportError:
    """An export's output is there already (each front end words ``overwrite=True`` its way)."""
    return ExportError("already exists; pass overwrite=True to replace it", file=where,
                       option=("overwrite", "overwrite=True"))
