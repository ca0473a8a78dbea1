"""The native decoders' memory rules, checked on their source (see _metadata.c's STORAGE
comment): growable arrays are named only inside the STORAGE blocks, no pointer to a node
is declared outside them, a node is written only through node_w() in one expression, and
_opscan.clean() refuses a limit past the data (the FRAME sum's bound)."""

from __future__ import annotations

import re

import pytest

from inspector.formats.safe_pickle import prescan
from tests.native.sanitized import EXTENSIONS, ROOT

# The growable arrays of each file (the fields PyMem_Realloc resizes).
GROWABLE = {
    "inspector/formats/safe_pickle/_metadata.c": (
        "nodes",
        "pool",
        "stack",
        "memo",
        "marks",
        "made",
    ),
    "inspector/formats/safe_pickle/_opscan.c": (),
    "inspector/formats/dcp/_table.c": ("items",),
    "inspector/analysis/_health.c": (),
}
BLOCK = re.compile(r"/\* STORAGE BEGIN.*?/\* STORAGE END \*/", re.DOTALL)


def outside_storage(name: str) -> str:
    """The file's code outside its STORAGE blocks, comments dropped."""
    text = BLOCK.sub("", (ROOT / name).read_text())
    return re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)


def test_every_extension_is_checked() -> None:
    assert set(GROWABLE) == set(EXTENSIONS)


@pytest.mark.parametrize("name", EXTENSIONS)
def test_growable_arrays_are_named_only_in_storage(name: str) -> None:
    code = outside_storage(name)
    for field in GROWABLE[name]:
        assert not re.findall(rf"(?:->|\.)\b{field}\b", code), f"{name}: {field} outside STORAGE"
    realloc = re.findall(r"PyMem_Realloc|realloc\(", code)
    assert not realloc, f"{name}: an array grown outside STORAGE"


def test_no_node_pointer_is_kept() -> None:
    code = outside_storage("inspector/formats/safe_pickle/_metadata.c")
    assert not re.findall(r"\bNode\s*\*", code)
    writes = re.findall(r"node_w\([^;]*", code)
    assert writes
    for write in writes:
        assert re.fullmatch(r"node_w\([^()]*(?:\([^()]*\))?[^()]*\)->\w+ = .*", write, re.DOTALL), (
            write
        )


def test_opscan_refuses_a_limit_past_the_data() -> None:
    if prescan._clean is None:
        pytest.skip("built without a compiler")
    data = b"\x80\x04\x95" + (2**63 - 1).to_bytes(8, "little") + b"N."
    with pytest.raises(ValueError, match="limit"):
        prescan._clean(data, 0, 2**63 - 1, prescan._OPSCAN_TABLE)
    assert prescan._clean(data, 0, len(data), prescan._OPSCAN_TABLE) is False
