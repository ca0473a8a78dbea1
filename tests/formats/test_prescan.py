"""The opcode pre-scan: the C fast path accepts genuine pickles at once and never accepts
one the Python scan refuses (checked on genuine, hostile and randomly damaged pickles)."""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inspector.errors import CorruptCheckpointError
from inspector.formats.safe_pickle import prescan
from tests.hostile import opcodes

VALUES = [
    {"lr": 0.1, "betas": (0.9, 0.95), "name": "adamw", "steps": list(range(300))},
    [b"x" * 300, "y" * 70_000, 2**70, -3, 1.5, None, True, {1, 2}],
    {f"layers.{i}.weight": (i, [i] * 3, {"i": i}) for i in range(400)},
]


def python_scan_accepts(data: bytes) -> bool:
    """What the Python scan says: every claim within the pickle's size, and well-formed."""
    try:
        return all(claimed <= len(data) for _, claimed in prescan._claimed_sizes(data, 0))
    except (ValueError, IndexError):
        return False


def checked(data: bytes) -> int:
    return prescan.check_sizes(io.BytesIO(data), file="p", key=None, data=data)


def test_the_c_scan_is_built() -> None:
    """make test builds it (a missing compiler would leave only the Python scan)."""
    assert prescan.fast_scan_clean(pickle.dumps(1), 0) is True


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_genuine_pickles_agree(protocol: int) -> None:
    for value in VALUES:
        data = pickle.dumps(value, protocol=protocol)
        assert python_scan_accepts(data) and checked(data) == len(data)
        # protocol 0 names memo slots by text (PUT): left to the Python scan
        assert prescan.fast_scan_clean(data, 0) is (protocol > 0)


def test_real_checkpoint_pickles_take_the_fast_path(demo_dir: Path) -> None:
    metadata = (demo_dir / "flat" / ".metadata").read_bytes()
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(3), "step": 7}, buffer)
    data_pkl = opcodes.data_pkl(buffer.getvalue())
    for data in (metadata, data_pkl):
        assert prescan.fast_scan_clean(data, 0) and python_scan_accepts(data)


def test_the_fast_path_starts_where_the_pickle_does() -> None:
    data = b"\xff" * 5 + pickle.dumps(VALUES[0], protocol=4)
    assert prescan.fast_scan_clean(data, 5) is True
    assert prescan.fast_scan_clean(data, 0) is False  # 0xff is no opcode


HOSTILE = {
    "memo index": opcodes.EMPTY_LIST + opcodes.put(2**31) + b".",
    "frame length": b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.",
    "nested frame": b"\x80\x04\x95" + struct.pack("<Q", 11)
    + b"\x95" + struct.pack("<Q", 1) + b"N.",
    "bytes past the end": b"B" + struct.pack("<I", 2**31) + b"abc.",
    "bytes8 past the end": b"\x8e" + struct.pack("<Q", 2**63) + b".",
    "text memo index": b"]p99999999999\n.",
    "no stop": pickle.dumps([1, 2])[:-1],
    "unknown opcode": b"N\xff.",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_claims_go_to_the_python_scan(name: str) -> None:
    data = HOSTILE[name]
    assert prescan.fast_scan_clean(data, 0) is False
    with pytest.raises(CorruptCheckpointError, match=r"^p: "):
        checked(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=st.sampled_from(VALUES),
    protocol=st.integers(1, pickle.HIGHEST_PROTOCOL),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "insert"]),
            st.floats(0, 1),
            st.binary(min_size=1, max_size=9),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_the_fast_path_never_accepts_what_python_refuses(value, protocol, edits) -> None:
    data = bytearray(pickle.dumps(value, protocol=protocol))
    for kind, where, payload in edits:
        at = int(where * (len(data) - 1))
        if kind == "flip":
            data[at] ^= payload[0] or 1
        elif kind == "cut":
            del data[at : at + len(payload)]
        else:
            data[at:at] = payload
    damaged = bytes(data)
    if prescan.fast_scan_clean(damaged, 0):
        assert python_scan_accepts(damaged)
