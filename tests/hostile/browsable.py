"""Class 6, the rest stays browsable (and class 5, agreement with torch): a real torch.save
file whose pickle or archive is damaged for ONE tensor (offset past its storage, absurd or
negative sizes, a stride list of the wrong length, state given to the tensor, a compressed
storage record), or made ambiguous (two records with one name, one storage under two
dtypes). Exactly the damaged key is marked (``entry.error``); every other key reads equal
to what was saved; where torch.load(weights_only=True) loads the file, every key that is
not marked reads exactly as torch reads it."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase


def _saved() -> dict[str, Any]:
    import torch

    return {
        "a": torch.arange(4.0),
        "b": torch.arange(4, dtype=torch.int32),
        "c": {"d": torch.full((2, 2), 3.0, dtype=torch.bfloat16)},
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


def _dup(order: str):
    import torch

    fake = torch.full((4,), 7.0).numpy().tobytes()

    def change(name: str, data: bytes):
        if not name.endswith("/data/0"):
            return [(name, data, 0)]
        pair = [(name, data, 0), (name, fake, 0)]
        return pair if order == "genuine-first" else pair[::-1]

    return change


AMBIGUOUS = {  # name: (archive change, what a marked key's error says)
    "duplicate-genuine-first": (_dup("genuine-first"), "records named"),
    "duplicate-fake-first": (_dup("fake-first"), "records named"),
    "storage-two-dtypes": (_in_pickle(b"IntStorage\nq\x0fX\x01\x00\x00\x001",
                                      b"IntStorage\nq\x0fX\x01\x00\x00\x000"), "-"),
}


def agree(args: dict[str, Any], report: Report) -> None:
    """Every key either reads exactly as torch.load(weights_only=True) loads it, or is
    marked with the reason."""
    import warnings

    import torch

    import inspector
    from inspector.errors import InspectorError

    tmp = Path(args["tmp"])
    path = tmp / "state.pt"
    torch.save(_saved(), path)
    _rewrite(path, AMBIGUOUS[args["ambiguity"]][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        truth = torch.load(path, weights_only=True)
    ck = inspector.open(path)
    shown = 0
    for key, want in (("a", truth["a"]), ("b", truth["b"]), ("c.d", truth["c"]["d"])):
        if ck.entry(key).error is None:
            got = ck.read(key)
            assert got.dtype == want.dtype and torch.equal(got, want), (key, got, want)
            shown += 1
    marked = {k for k in ck.keys() if ck.entry(k).error}
    for key in marked:
        assert args["says"] in ck.entry(key).error, ck.entry(key).error
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
        for name, (_, says) in AMBIGUOUS.items()
    },
}
