"""Pickles that would run code, planted where checkpoints keep pickles: ``.metadata``, a
tensor chunk's ``data.pkl``, a non-tensor DCP item, a ``.pt`` file, and a ``.pt`` zip with
extra records. Every payload targets a marker file (or a victim folder, or an import)."""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import io
import os
import pickle
import runpy
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from inspector.errors import CorruptCheckpointError, UnsafeCheckpointError
from tests.fixtures.damage import append_item, dcp_metadata, write_dcp_metadata
from tests.hostile.case import Case, Generator, Genuine

_OBJECT = "train_state.step"  # a non-tensor item of the DCP checkpoint


class Payload:
    """Pickles as a call of ``func(*args)``: what a hostile checkpoint contains."""

    def __init__(self, func: Callable, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def payloads(marker: Path) -> dict[str, Payload]:
    """Each way a pickle can run code, aimed at ``marker`` (``arm`` prepares its folder)."""
    folder = marker.parent
    return {
        "os.system": Payload(os.system, f"touch {marker}"),
        "subprocess": Payload(subprocess.call, ["touch", str(marker)]),
        "eval": Payload(builtins.eval, f"open({str(marker)!r}, 'w')"),
        "exec": Payload(builtins.exec, f"open({str(marker)!r}, 'w')"),
        "__import__": Payload(builtins.__import__, "this"),
        "importlib": Payload(importlib.import_module, "this"),
        "runpy": Payload(runpy.run_path, str(folder / "payload.py")),
        "shutil.rmtree": Payload(shutil.rmtree, str(folder / "victim")),
    }


def arm(folder: Path) -> tuple[Path, Path]:
    """The marker (absent) and the victim folder (present) the payloads aim at."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "marker"
    (folder / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (folder / "victim").mkdir()
    return marker, folder / "victim"


def torch_saved(value: Any) -> bytes:
    """``torch.save(value)`` as bytes: a DCP item or a ``.pt`` file."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _in_metadata(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    metadata.planner_data["norm.weight"] = ("norm.weight", payload)
    write_dcp_metadata(folder, metadata)
    return Case(folder, ".metadata", refused=True, error=UnsafeCheckpointError)


def _in_chunk(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    """A tensor chunk whose pickle carries the payload as a tensor attribute."""
    folder = genuine.copy("seed", tmp)
    metadata = dcp_metadata(folder)
    tensor = torch.zeros(tuple(metadata.state_dict_metadata["norm.weight"].size))
    tensor.config = payload
    append_item(folder, metadata, "norm.weight", torch_saved(tensor))
    write_dcp_metadata(folder, metadata)
    return Case(folder, "__0_0.distcp", bad=frozenset({"norm.weight"}), reference=genuine.seed)


def _in_object(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    folder = genuine.copy("distcp_safetensors", tmp)
    metadata = dcp_metadata(folder)
    append_item(folder, metadata, _OBJECT, torch_saved({"step": payload}))
    write_dcp_metadata(folder, metadata)
    return Case(
        folder,
        "__0_0.distcp",
        bad=frozenset({_OBJECT}),
        error=UnsafeCheckpointError,
        reference=genuine.distcp_safetensors,
    )


def _in_pt(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    state = torch.load(genuine.model_bin, weights_only=True)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "pytorch_model.bin"
    path.write_bytes(torch_saved({**state, "config": {"init": payload}}))
    return Case(path, path.name, refused=True, error=UnsafeCheckpointError)


def _in_extra_records(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    """Payload pickles in records torch.save never writes: ignored, the file reads as before."""
    path = genuine.copy("pt", tmp)
    with zipfile.ZipFile(path, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        for name in (f"{prefix}/extra.pkl", f"{prefix}/data/999", f"{prefix}/.data/hook.pkl"):
            archive.writestr(name, pickle.dumps(payload))
    return Case(path, reference=genuine.pt)


def _shadow_archive(genuine: Genuine, tmp: Path, payload: Payload) -> Case:
    """A payload ``data.pkl`` in a second archive folder placed before the genuine one:
    torch.load refuses records outside the first record's folder, and so is the file, before
    any pickle is read."""
    path = tmp / genuine.pt.name
    tmp.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(genuine.pt) as src, zipfile.ZipFile(path, "w") as dst:
        dst.writestr("shadow/data.pkl", pickle.dumps(payload, protocol=2))
        dst.writestr("shadow/byteorder", "little")
        for info in src.infolist():
            dst.writestr(info, src.read(info))
    return Case(path, path.name, refused=True, error=CorruptCheckpointError,
                says="torch.load refuses")


LOCATIONS: dict[str, Callable[[Genuine, Path, Payload], Case]] = {
    "metadata": _in_metadata,
    "chunk": _in_chunk,
    "object": _in_object,
    "pt": _in_pt,
    "pt-extra-records": _in_extra_records,
    "pt-shadow-archive": _shadow_archive,
}


def _case(location: str, payload: str, genuine: Genuine, tmp: Path) -> Case:
    marker, victim = arm(tmp / "target")
    case = LOCATIONS[location](genuine, tmp / "checkpoint", payloads(marker)[payload])
    says = None if case.file is None else case.says or "nothing was executed"
    return dataclasses.replace(case, marker=marker, victim=victim, says=says)


CASES: dict[str, Generator] = {
    f"pickle:{payload}@{location}": partial(_case, location, payload)
    for location in LOCATIONS
    for payload in payloads(Path("/x"))
}
