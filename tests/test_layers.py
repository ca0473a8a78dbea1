"""The package's layers (DESIGN.md): imports point downward only, checked on every module's
imports (function-level and type-checking ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "inspector"

# Lowest first; a module may import its own layer and the ones below.
LAYERS = (
    (
        "inspector.components",
        "inspector.entry",
        "inspector.errors",
        "inspector.dtypes",
        "inspector.gc_pause",
        "inspector.processes",
        "inspector.progress",
        "inspector.reprs",
        "inspector.version",
        "inspector.words",
    ),
    ("inspector.storage",),
    ("inspector.formats",),
    ("inspector.keys", "inspector.tensors"),
    ("inspector.checkpoint",),
    ("inspector.analysis",),
    ("inspector.exporting",),
    ("inspector.ui", "inspector.demo", "inspector"),  # the app and CLI use the public API
    ("inspector.__main__",),
)
# The only upward references: Checkpoint's conveniences that users reach by tab completion.
CONVENIENCES = {
    ("inspector.checkpoint", "inspector.analysis.audit"),
    ("inspector.checkpoint", "inspector.analysis.consistency"),
    ("inspector.checkpoint", "inspector.analysis.stats"),
}
# What the layers above formats/ may use of it: the reader interface, detection, records,
# and (for exports) the writers. Everything else a format knows stays inside formats/.
FORMAT_SURFACE = (
    "inspector.formats.base",
    "inspector.formats.detect",
    "inspector.formats.writing",
    "inspector.formats.safe_pickle",
    "inspector.formats.producers",
)
FORMAT_WRITERS = (
    "inspector.formats.safetensors",
    "inspector.formats.torch_save.writer",
    "inspector.formats.dcp.writer",
    "inspector.formats.dcp.megatron_writer",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[1])
            ):
                best = (level, prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def imports(path: Path) -> set[str]:
    """Every inspector module ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "inspector"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "inspector":
            modules = {f"{node.module}.{a.name}" for a in node.names if _is_module(node, a)}
            found |= modules if len(modules) == len(node.names) else {str(node.module), *modules}
    return found


def _is_module(node: ast.ImportFrom, alias: ast.alias) -> bool:
    """``from inspector.formats import safe_pickle`` imports a module, not a name."""
    base = PACKAGE.parent.joinpath(*f"{node.module}.{alias.name}".split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path) -> None:
    me = module_name(path)
    upward = sorted(
        other
        for other in imports(path)
        if layer_of(other) > layer_of(me)
        and not any(me == a and other.startswith(b) for a, b in CONVENIENCES)
    )
    assert upward == [], f"{me} imports from layers above it: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_format_knowledge_stays_in_formats(path: Path) -> None:
    me = module_name(path)
    if layer_of(me) <= layer_of("inspector.formats"):
        return
    allowed = FORMAT_SURFACE + (FORMAT_WRITERS if me.startswith("inspector.exporting") else ())
    leaks = sorted(
        other
        for other in imports(path)
        if other.startswith("inspector.formats.")
        and not any(other == a or other.startswith(a + ".") for a in allowed)
    )
    assert leaks == [], f"{me} reaches inside formats/: {leaks}"


def test_the_widgets_are_the_only_ipywidgets_users() -> None:
    users = [
        module_name(p)
        for p in MODULES
        if "ipywidgets" in {n.split(".")[0] for n in _all_imports(p)}
    ]
    assert users and all(m.startswith("inspector.ui.widgets") for m in users), users


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# The package's face: it loads the public API lazily by module name (a string) and imports
# it only for type checkers, so the app's ``import inspector`` closes no real circle.
FACADE = ("inspector",)


def import_circles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among ``modules`` (name -> the inspector modules it imports), each
    as the path that closes it; a package counts as importing its ``__init__``'s imports."""
    circles, state = [], dict.fromkeys(modules, 0)  # 0 new, 1 on the path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(modules[name]):
            if state.get(other) == 1:
                circles.append([*path[path.index(other):], other])
            elif state.get(other) == 0:
                visit(other, [*path, other])
        state[name] = 2

    for name in modules:
        if state[name] == 0:
            visit(name, [name])
    return circles


def test_no_import_circle_inside_a_layer() -> None:
    """Within a layer, imports form no circle (function-level and type-checking ones
    included), so each layer's modules read from the bottom up."""
    names = {module_name(p): p for p in MODULES if module_name(p) not in FACADE}
    modules = {
        me: {o for o in imports(path) if o in names and o != me and layer_of(o) == layer_of(me)}
        for me, path in names.items()
    }
    assert import_circles(modules) == []


def test_an_import_circle_is_caught() -> None:
    """The check itself can fail: run -> hf_folder -> run is a circle."""
    modules = {"a.run": {"a.hf_folder", "a.base"}, "a.hf_folder": {"a.run"}, "a.base": set()}
    assert import_circles(modules) == [["a.run", "a.hf_folder", "a.run"]]


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a formats module importing the checkpoint is upward."""
    bad = PACKAGE / "formats" / "base.py"
    assert layer_of("inspector.checkpoint") > layer_of(module_name(bad))
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from inspector.checkpoint import Checkpoint\n")
    assert imports(sample) == {"inspector.checkpoint"}
