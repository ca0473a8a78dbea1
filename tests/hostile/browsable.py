"""Class 6, the rest stays browsable (and class 5, agreement with torch): a real torch.save
file whose pickle or archive is damaged for ONE tensor (offset past its storage or
negative, absurd or negative sizes, a negative stride or a stride list of the wrong length,
state given to the tensor, a compressed or missing storage record), or made ambiguous (two
records with one name, one storage under two dtypes or sizes, records that overlap, records
outside the first record's folder). Exactly the damaged key is marked (``entry.error``);
every other key reads equal to what was saved; where torch.load(weights_only=True) loads
the file, every key that is not marked reads exactly as torch reads it."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase


def _saved(scale: float = 1.0) -> dict[str, Any]:
    import torch

    return {
        "a": torch.arange(4.0) * scale,
        "b": torch.arange(4, dtype=torch.int32) * int(scale),
        "c": {"d": torch.full((2, 2), 3.0 * scale, dtype=torch.bfloat16)},
    }


def _rewrite(path: Path, change) -> None:
    """The archive with ``change(name, data) -> [(name, data, compress_type)]`` per record."""
    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records:
            for new_name, new_data, how in change(name, data):
                z.writestr(zipfile.ZipInfo(new_name), new_data, compress_type=how)
    path.write_bytes(out.getvalue())


def _in_pickle(old: bytes, new: bytes):
    def change(name: str, data: bytes):
        if name.endswith("data.pkl"):
            assert data.count(old) == 1, (old, data)
            data = data.replace(old, new)
        return [(name, data, zipfile.ZIP_STORED)]

    return change


# The pickle of _saved() (protocol 2) spells tensor "a" as ... storage 'FloatStorage', '0',
# offset K\x00, size (4,), stride (1,) ... and "b" with q\x0e...IntStorage, '1'.
A_ARGS = b"K\x00K\x04\x85q\x08K\x01\x85q\t"
DAMAGE = {  # name: (archive change, key marked, what its error says, torch loads the file)
    "offset-past-storage": (
        _in_pickle(A_ARGS, b"K\x09K\x04\x85q\x08K\x01\x85q\t"), "a", "past its storage"),
    "absurd-size": (
        _in_pickle(A_ARGS, b"K\x00\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40\x85q\x08K\x01\x85q\t"),
        "a", "size"),
    "negative-size": (
        _in_pickle(A_ARGS, b"K\x00J\xff\xff\xff\xff\x85q\x08K\x01\x85q\t"), "a", "size"),
    "stride-length": (
        _in_pickle(A_ARGS, b"K\x00K\x04\x85q\x08K\x01K\x01\x86q\t"), "a", "differ in length"),
    "state-on-tensor": (
        _in_pickle(b"tq\x0cRq\r", b"tq\x0cRq\r}b"), "a", "state"),
    "compressed-record": (
        lambda n, d: [(n, d, zipfile.ZIP_DEFLATED if n.endswith("/data/1") else 0)],
        "b", "compressed"),
    "missing-record": (lambda n, d: [] if n.endswith("/data/1") else [(n, d, 0)], "b",
                       "lacks storage record"),
    "negative-offset": (
        _in_pickle(A_ARGS, b"J\xff\xff\xff\xffK\x04\x85q\x08K\x01\x85q\t"), "a", "offset"),
    "negative-stride": (
        _in_pickle(A_ARGS, b"K\x00K\x04\x85q\x08J\xff\xff\xff\xff\x85q\t"), "a", "stride"),
}


def run(args: dict[str, Any], report: Report) -> None:
    import torch

    import inspector
    from inspector.errors import InspectorError
    from tests.hostile.guard import guarded

    tmp = Path(args["tmp"])
    saved = _saved()
    path = tmp / "state.pt"
    torch.save(saved, path)
    change, bad, says = DAMAGE[args["damage"]]
    _rewrite(path, change)
    with guarded(tmp):
        ck = inspector.open(path)
        marked = {k for k in ck.keys() if ck.entry(k).error}
        assert marked == {bad}, {k: ck.entry(k).error for k in marked}
        assert says in ck.entry(bad).error, ck.entry(bad).error
        try:
            ck.read(bad)
        except InspectorError as exc:
            assert repr(bad) in str(exc) and "state.pt" in str(exc), exc
        else:
            raise AssertionError(f"{bad!r} read despite its damage")
        for key, want in (("a", saved["a"]), ("b", saved["b"]), ("c.d", saved["c"]["d"])):
            if key != bad:
                got = ck.read(key)
                assert got.dtype == want.dtype and torch.equal(got, want), key
    report({"marked": sorted(marked)})


def _dup(order: str, suffix: str = "/data/0"):
    """The record ending in ``suffix`` twice, the genuine one first or second; the other
    holds other values (a pickle of other tensors, or sevens)."""
    import torch

    fake = torch.full((4,), 7.0).numpy().tobytes()
    if suffix == "data.pkl":
        fake = _records(_saved(scale=7.0))["archive/data.pkl"]

    def change(name: str, data: bytes):
        if not name.endswith(suffix):
            return [(name, data, 0)]
        pair = [(name, data, 0), (name, fake, 0)]
        return pair if order == "genuine-first" else pair[::-1]

    return change


def _records(value: Any) -> dict[str, bytes]:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _decoy() -> list[tuple[str, bytes, int]]:
    return [("decoy/" + n.split("/", 1)[1], d, 0) for n, d in _records(_saved(5.0)).items()]


def _decoy_folder(name: str, data: bytes):
    """Another archive's records in folder ``decoy/``, listed first: torch.load reads the
    folder of the first record and refuses records outside it."""
    if not name.endswith("/data.pkl"):
        return [(name, data, 0)]
    decoy = _decoy()
    return [*decoy, (name, data, 0)]


def _decoy_first(name: str, data: bytes):
    if not name.endswith("/data.pkl"):
        return [(name, data, 0)]
    decoy = _decoy()
    return [decoy[-1], (name, data, 0), *decoy[:-1]]


def _loose_first(name: str, data: bytes):
    return [("README", b"not a tensor", 0), (name, data, 0)] if name.endswith("data.pkl") else [
        (name, data, 0)]


def _directory(path: Path, record: str, **fields: int) -> None:
    """Point the central directory's entry for ``name`` elsewhere: ``at`` the local header
    of another record (``crc``, ``size`` too), so records overlap as torch's reader sees
    them."""
    import struct

    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
    name = infos[record].filename
    pos = raw.find(b"PK\x01\x02")
    while pos >= 0:
        length = struct.unpack_from("<H", raw, pos + 28)[0]
        if raw[pos + 46: pos + 46 + length] == name.encode():
            if "at" in fields:
                other = infos[f"data/{fields['at']}"]
                struct.pack_into("<I", raw, pos + 42, other.header_offset)
                if fields.get("crc"):
                    struct.pack_into("<I", raw, pos + 16, other.CRC)
            if "size" in fields:
                struct.pack_into("<II", raw, pos + 20, fields["size"], fields["size"])
        pos = raw.find(b"PK\x01\x02", pos + 4)
    path.write_bytes(bytes(raw))


# In the pickle, "b" names its storage as ... 'torch IntStorage', '1', 'cpu', 4 elements.
A_STORAGE = b"X\x01\x00\x00\x000q\x05X\x03\x00\x00\x00cpuq\x06K\x04t"
B_STORAGE = b"IntStorage\nq\x0fX\x01\x00\x00\x001q\x10h\x06K\x04t"
AMBIGUOUS = {  # name: (archive change, directory change, what refuses: a marked key's error
    # or the open; when torch refuses the whole file, the key it refuses, "" for all)
    "duplicate-genuine-first": (_dup("genuine-first"), {}, "records named", None),
    "duplicate-fake-first": (_dup("fake-first"), {}, "records named", None),
    "duplicate-pickle-genuine-first": (_dup("genuine-first", "data.pkl"), {}, "records named",
                                       None),
    "duplicate-pickle-fake-first": (_dup("fake-first", "data.pkl"), {}, "records named", None),
    "duplicate-byteorder": (_dup("genuine-first", "byteorder"), {}, "records named", None),
    "storage-two-dtypes": (_in_pickle(B_STORAGE, B_STORAGE.replace(b"001", b"000")), {}, "-",
                           None),
    "storage-two-sizes": (_in_pickle(B_STORAGE, b"FloatStorage\nq\x0fX\x01\x00\x00\x000q\x10h"
                                                b"\x06K\x02t"), {}, "-", None),
    "storage-smaller-first": (_in_pickle(A_STORAGE, A_STORAGE.replace(b"K\x04t", b"K\x02t")),
                              {}, "past its storage", "a"),
    "overlap-same-bytes": (None, {"record": "data/1", "at": 0}, "-", None),
    "overlap-same-bytes-crc": (None, {"record": "data/1", "at": 0, "crc": 1}, "-", None),
    "overlap-grown": (None, {"record": "data/0", "size": 200}, "torch.load refuses it",
                      "a"),
    "overlap-shrunk": (None, {"record": "data/1", "size": 8}, "torch.load refuses it", "b"),
    "decoy-folder-first": (_decoy_folder, {}, "torch.load refuses", ""),
    "decoy-pickle-first": (_decoy_first, {}, "torch.load refuses", ""),
    "loose-record-first": (_loose_first, {}, "torch.load refuses", ""),
}


def agree(args: dict[str, Any], report: Report) -> None:
    """Every key either reads exactly as torch.load(weights_only=True) loads it, or is
    marked with the reason (or the whole file is refused with it); where torch refuses the
    whole file, the key it refuses is marked and the others read as saved."""
    import warnings

    import torch

    import inspector
    from inspector.errors import InspectorError

    tmp = Path(args["tmp"])
    path = tmp / "state.pt"
    torch.save(_saved(), path)
    change, directory, says, refused = AMBIGUOUS[args["ambiguity"]]
    if change is not None:
        _rewrite(path, change)
    if directory:
        _directory(path, **directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            truth = torch.load(path, weights_only=True)
        except RuntimeError:
            assert refused is not None, "torch.load refused the file"
            truth = {**_saved(), refused: None} if refused else {}
        else:
            assert refused is None, f"torch.load loaded {truth}"
    try:
        ck = inspector.open(path)
    except InspectorError as exc:  # refused whole, with the reason
        assert says in str(exc) and "state.pt" in str(exc), exc
        report({"refused": str(exc)})
        return
    assert truth, "opened a file torch.load refuses whole"
    shown, wants = 0, {"a": truth["a"], "b": truth["b"], "c.d": truth["c"]["d"]}
    for key, want in wants.items():
        if ck.entry(key).error is None:
            assert want is not None, f"{key!r} shown although torch.load refuses it"
            got = ck.read(key)
            assert got.dtype == want.dtype and torch.equal(got, want), (key, got, want)
            shown += 1
    marked = {k for k in ck.keys() if ck.entry(k).error}
    for key in marked:
        assert says in ck.entry(key).error, ck.entry(key).error
    try:
        inspector.fingerprint(ck)
    except InspectorError as exc:  # a marked key is never hashed as some value
        assert exc.key in marked, exc
    else:
        assert not marked, marked
    report({"shown": shown, "marked": sorted(marked)})
    assert shown >= 2 and shown + len(marked) == 3, (shown, marked)


CASES = {
    **{
        f"browsable:{name}": TrustCase("tests.hostile.browsable:run", {"damage": name})
        for name in DAMAGE
    },
    **{
        f"agreement:{name}": TrustCase(
            "tests.hostile.browsable:agree", {"ambiguity": name, "says": says}
        )
        for name, (_, _, says, _) in AMBIGUOUS.items()
    },
}
