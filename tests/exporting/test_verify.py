"""Verification by digests: a flipped byte in the output, or in the source between write and
verify, or a source damaged at rest, is reported by tensor; plain exports need no torch."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.exporting.run import Progress
from tests.conftest import run_python
from tests.fixtures.damage import flip_byte
from tests.fixtures.formats import same

FORMATS = [("safetensors", "out"), ("pt", "out.pt")]


def written_file(out: Path) -> Path:
    return out if out.suffix == ".pt" else out / "model.safetensors"


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
def test_a_flipped_byte_in_the_output_names_its_tensor(
    demo_dir: Path, tmp_path: Path, fmt: str, name: str
) -> None:
    out = tmp_path / name
    flipped = []

    def on_progress(p: Progress) -> None:
        if p.phase == "verify" and not flipped:  # the first tensor is checked: damage the last
            written = inspector.open(written_file(out))
            last = written.keys()[-1]
            flip_byte(written_file(out), written.byte_ranges(last)[0].offset + 3)
            flipped.append(last)

    result = inspector.export(
        demo_dir / "flat", out, format=fmt, on_progress=on_progress, progress=False
    )
    assert result.verification.ok is False
    assert result.verification.mismatched == (flipped[0],)
    assert "output bytes differ" in result.verification.reasons[flipped[0]]
    assert flipped[0] in str(result.verification)


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
def test_a_source_changed_between_write_and_verify_is_not_accepted(
    demo_copy, tmp_path: Path, fmt: str, name: str
) -> None:
    source = demo_copy("seed")
    ck = inspector.open(source)
    key = "layers.1.attention.wk.weight"
    where = ck.byte_ranges(key)[0]

    def on_progress(p: Progress) -> None:
        if p.phase == "write" and p.done == p.total:  # every byte written, none verified
            flip_byte(source / where.name, where.offset + 5)

    result = inspector.export(ck, tmp_path / name, format=fmt, on_progress=on_progress)
    assert result.verification.mismatched == (key,)
    assert "source changed since it was read" in result.verification.reasons[key]
    assert where.name in result.verification.reasons[key]


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
def test_a_source_damaged_before_the_export_misses_its_own_crc(
    demo_copy, tmp_path: Path, fmt: str, name: str
) -> None:
    """The DCP item's recorded CRC-32 stands in for reading the source: a copy of damaged
    bytes cannot match it, and the .pt written keeps the record CRC that shows it."""
    source = demo_copy("flat")
    ck = inspector.open(source)
    key = "layers.0.feed_forward.w2.weight"
    second = ck.byte_ranges(key)[1]
    assert second.crc is not None  # the record's own CRC-32
    flip_byte(source / second.name, second.offset + 17)
    result = inspector.export(source, tmp_path / name, format=fmt, progress=False)
    assert result.verification.mismatched == (key,)
    assert "damaged source" in result.verification.reasons[key]
    if fmt == "pt":
        assert zipfile.ZipFile(tmp_path / name).testzip() is not None


def test_pt_record_crcs_combined_from_the_source_chunks_are_right(
    demo_dir: Path, tmp_path: Path
) -> None:
    """Each tensor of the 2-rank save is two DCP items; the .pt record's CRC-32 is combined
    from theirs (the source bytes are not read for it) and matches the bytes written."""
    ck = inspector.open(demo_dir / "flat")
    assert all(r.crc is not None for r in ck.byte_ranges("layers.0.attention.wq.weight"))
    assert len(ck.byte_ranges("layers.0.attention.wq.weight")) == 2
    out = tmp_path / "o.pt"
    result = inspector.export(ck, out, format="pt", verify=False, progress=False)
    assert result.verification is None
    assert zipfile.ZipFile(out).testzip() is None
    loaded = torch.load(out, weights_only=True)
    assert all(same(v, ck.read(k)) for k, v in loaded.items())


def test_plain_safetensors_export_and_verification_never_import_torch(
    demo_dir: Path, tmp_path: Path
) -> None:
    code = (
        "import sys, inspector\n"
        "r = inspector.export(sys.argv[1], sys.argv[2], progress=False)\n"
        "assert r.verification.ok and r.conversions == {}, r.summary()\n"
        "print(r.tensors, 'torch' in sys.modules)\n"
    )
    done = run_python(code, str(demo_dir / "seed"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["21", "False"]
    ck = inspector.open(demo_dir / "seed")
    for key, value in load_file(tmp_path / "out" / "model.safetensors").items():
        assert same(value, ck.read(key)), key


def _verify_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("inspector-verify")]


def test_verification_stops_when_its_caller_does(demo_dir: Path, tmp_path: Path) -> None:
    """Tensors are re-read a few at a time in threads; an error from the progress callback
    (the app's Cancel) ends the verification there, and no thread is left behind."""
    checked = []

    class Stop(Exception):
        pass

    def on_progress(p: Progress) -> None:
        if p.phase == "verify":
            checked.append(p.key)
            if len(checked) == 2:
                raise Stop

    with pytest.raises(Stop):
        inspector.export(demo_dir / "flat", tmp_path / "out", on_progress=on_progress,
                         progress=False)
    assert len(checked) == 2 and _verify_threads() == []
    done = inspector.export(demo_dir / "flat", tmp_path / "again", progress=False)
    assert done.verification.ok and done.verification.checked == done.tensors > 8
    assert _verify_threads() == []
