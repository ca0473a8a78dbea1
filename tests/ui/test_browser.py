"""The app in a real browser: JupyterLab runs inspect.ipynb in headless Chromium, a user clicks.

Skipped when chromium or playwright is missing, except in CI (``CI=true``), where that
fails. Every test saves a screenshot under its own tmp folder and names it (and the server
log) when it fails; the Stats and dark-theme tests keep a picture of the whole app under
the module's ``browser-shots`` folder (docs/screenshots.py takes the README's pictures).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inspector
from inspector.demo.model import build_model
from tests.fixtures.lab import CHROMIUM, CHROMIUM_ARGS, Lab, browser_missing, start_lab

pytestmark = pytest.mark.browser

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
FP8_WEIGHT = "layers.0.attention.wq.weight"
KERNEL_TIMEOUT = 90_000
UI_TIMEOUT = 30_000
VIEWPORT = {"width": 1280, "height": 1600}
TALL = {"width": 1280, "height": 2100}
ROW = ".inspector-tree .inspector-row"


@pytest.fixture(scope="module")
def lab(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab on a copy of the notebooks, the demo checkpoints given by INSPECTOR_DEMO_DIR."""
    missing = browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser tests cannot run in CI: {missing}")
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("lab") / "notebooks"
    shutil.copytree(NOTEBOOKS, root)
    server = start_lab(
        root, tmp_path_factory.mktemp("lab-state"), {"INSPECTOR_DEMO_DIR": str(demo_dir)}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("browser-shots")


@contextmanager
def screenshot(page, path: Path, lab: Lab) -> Iterator[None]:
    """Save a screenshot when the block ends; on failure, name it and the server log."""
    try:
        yield
    except Exception as exc:
        page.screenshot(path=path)
        raise AssertionError(f"{exc}\nscreenshot: {path}\nserver log: {lab.log}") from exc
    page.screenshot(path=path)


@pytest.fixture(scope="module")
def page(lab: Lab, shots: Path):
    """inspect.ipynb open in Chromium with every cell run and the app drawn."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(
            viewport=VIEWPORT, permissions=["clipboard-read", "clipboard-write"]
        )
        tab = context.new_page()
        tab.set_default_timeout(UI_TIMEOUT)
        with screenshot(tab, shots / "00-run-all.png", lab):
            lab.start_kernel("inspect.ipynb")
            tab.goto(lab.url("inspect.ipynb"))
            tab.wait_for_selector(
                ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=KERNEL_TIMEOUT
            )
            accept_kernel_dialog(tab)
            tab.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
            run_all(tab)
        yield tab
        browser.close()


def accept_kernel_dialog(page) -> None:
    """Under load JupyterLab may still ask which kernel to use although one is running for
    the notebook; its default choice is that kernel."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with suppress(PlaywrightTimeout):
        page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click(timeout=3000)


def run_all(page, attempts: int = 2) -> None:
    """Run > Run All Cells until the app is drawn (a second try if the kernel was not ready)."""
    for attempt in range(1, attempts + 1):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_selector(ROW, timeout=KERNEL_TIMEOUT / attempts)
            return
        except Exception:
            if attempt == attempts:
                raise


def until(condition: Callable[[], object], what: str, timeout: float = UI_TIMEOUT / 1000) -> None:
    """Poll ``condition`` (widgets update asynchronously) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def rows(page) -> list[str]:
    """The tree's rows as shown, no-break spaces made plain."""
    texts = page.locator(f"{ROW} span").all_inner_texts()
    return [t.replace("\xa0", " ") for t in texts]


def top_level(page) -> list[str]:
    """The names of the tree's unindented rows."""
    return [r.split()[1] for r in rows(page) if not r.startswith(" ")]


def pick(page, name: str) -> None:
    """Select the first tree row whose name is ``name``."""
    names = [r.split()[1] for r in rows(page)]
    page.locator(ROW).nth(names.index(name)).click()


def select_key(page, key: str) -> None:
    """Filter the tree (glob) to exactly ``key`` in the stored view and select its leaf."""
    page.locator(".inspector-view button", has_text="stored").click()
    page.locator(".inspector-filter-mode select").select_option("glob")
    box = page.locator(".inspector-filter input")
    box.fill(key)
    box.press("Enter")
    depth = key.count(".")
    until(lambda: len(rows(page)) == depth + 1, f"the tree filtered down to {key}")
    page.locator(ROW).nth(depth).click()
    until(lambda: key in page.locator(".inspector-tensor").inner_text(), f"details of {key}")


def test_view_toggle_respells_keys(page, lab: Lab, tmp_path: Path) -> None:
    with screenshot(page, tmp_path / "views.png", lab):
        page.locator(".inspector-filter input").fill("")
        page.locator(".inspector-filter input").press("Enter")
        page.locator(".inspector-view button", has_text="stored").click()
        until(lambda: "layers" in top_level(page), "stored view: layers at top level")
        assert "model" not in top_level(page)
        page.locator(".inspector-view button", has_text="prefixed").click()
        until(lambda: "model" in top_level(page), "prefixed view: model at top level")
        assert "layers" not in top_level(page)
        pick(page, "model")
        entries = page.locator(".inspector-entries")
        until(
            lambda: "model: entries 1-21 of 21" in entries.inner_text(), "the model node's entries"
        )
        assert "model.layers.0.attention.wq.weight" in entries.inner_text()
        page.locator(".inspector-view button", has_text="flattened").click()
        until(lambda: "layers" in top_level(page), "flattened view: layers at top level")


def test_fp8_weight_shows_its_subclass(page, lab: Lab, tmp_path: Path) -> None:
    with screenshot(page, tmp_path / "fp8-weight.png", lab):
        select_key(page, FP8_WEIGHT)
        details = page.locator(".inspector-tensor").inner_text()
        assert "WeightWithDynamicFloat8CastTensor" in details
        assert "wrapper -> float8_e4m3fn" in details
        assert "64x64" in details and "__0_0.distcp" in details and "__1_0.distcp" in details


def test_stats_shows_numbers_and_histogram(
    page, lab: Lab, shots: Path, tmp_path: Path, demo_dir: Path
) -> None:
    expected = inspector.open(demo_dir / "fp8").stats(FP8_WEIGHT)
    with screenshot(page, tmp_path / "stats.png", lab):
        select_key(page, FP8_WEIGHT)
        page.locator(".inspector-app button", has_text="Stats").click()
        stats = page.locator(".inspector-stats")
        until(lambda: "std" in stats.inner_text(), "the statistics table")
        shown = dict(re.findall(r"^(\w+)\s+(\S+)$", stats.inner_text(), re.MULTILINE))
        for name in ("min", "max", "mean", "std"):
            assert shown[name] == f"{getattr(expected, name):.6g}", name
        assert shown["nan"] == shown["inf"] == "0"
        for picture in ("histogram", "norms"):
            image = page.locator(f".inspector-{picture}")
            until(lambda i=image: i.evaluate("img => img.naturalWidth") > 0, f"the {picture}")
    page.set_viewport_size(TALL)  # the whole app, plots included
    try:
        page.locator(".inspector-app").evaluate("app => app.scrollIntoView()")
        page.screenshot(path=shots / "inspector.png")
    finally:
        page.set_viewport_size(VIEWPORT)


def test_export_writes_verified_safetensors(
    page, lab: Lab, demo_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "exported"
    with screenshot(page, tmp_path / "export.png", lab):
        page.locator(".inspector-tabs .lm-TabBar-tab", has_text="Export").click()
        page.locator(".inspector-export-out input").fill(str(out))
        page.locator(".inspector-export-out input").press("Enter")
        page.locator(".inspector-export").click()
        result = page.locator(".inspector-export-result")
        until(lambda: "verified 21 tensors bit-exact" in result.inner_text(), "a verified export")
        assert str(out / "model.safetensors") in result.inner_text()
    tensors = load_file(out / "model.safetensors")
    ck = inspector.open(demo_dir / "fp8")
    assert sorted(tensors) == sorted(build_model().state_dict())
    for key, value in tensors.items():
        assert torch.equal(value, ck.read(key)), key
    assert inspector.open(out).format == "safetensors"


def open_in_app(page, path: Path) -> None:
    """Type ``path`` into the app's path box and press Open; wait for its new tree (the
    tree shown before is marked, as the same path may be open already)."""
    page.evaluate("document.querySelectorAll('.inspector-rows').forEach(e => e.dataset.old = 1)")
    box = page.locator(".inspector-path input")
    box.fill(str(path))
    box.press("Enter")
    page.locator(".inspector-open").click()
    until(lambda: str(path) in page.locator(".inspector-where").inner_text(), f"{path} open")
    page.wait_for_selector(".inspector-rows:not([data-old]) .inspector-row")


def tab(page, title: str) -> None:
    page.locator(".inspector-tabs .lm-TabBar-tab", has_text=title).click()


def test_fp8_finding_converts_and_exports(
    page, lab: Lab, demo_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "converted"
    with screenshot(page, tmp_path / "fp8-finding.png", lab):
        open_in_app(page, demo_dir / "fp8")
        found = page.locator(".inspector-findings")
        until(
            lambda: "14 WeightWithDynamicFloat8CastTensor" in found.inner_text(),
            "the FP8 finding in the header",
        )
        assert "dcp_to_torch_save" in found.inner_text()
        page.locator(".inspector-convert-fp8").click()
        preset = page.locator(".inspector-export-preset")
        until(lambda: "FP8: unwrap" in preset.inner_text(), "the export preset to unwrap")
        page.locator(".inspector-export-out input").fill(str(out))
        page.locator(".inspector-export-out input").press("Enter")
        page.locator(".inspector-export").click()
        result = page.locator(".inspector-export-result")
        until(lambda: "verified" in result.inner_text(), "a verified export")
        assert "verified 21 tensors bit-exact" in result.inner_text()
    ck = inspector.open(demo_dir / "fp8")
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(build_model().state_dict())
    for key, value in tensors.items():
        assert type(value) is torch.Tensor and torch.equal(value, ck.read(key)), key


def test_compare_with_the_prefixed_demo(page, lab: Lab, demo_dir: Path, tmp_path: Path) -> None:
    model_keys = sorted(build_model().state_dict())
    with screenshot(page, tmp_path / "compare.png", lab):
        open_in_app(page, demo_dir / "flat")  # the FP8 demo is another run: other values
        tab(page, "Compare")
        page.locator(".inspector-compare-with input").fill(str(demo_dir / "prefixed"))
        page.locator(".inspector-compare-with input").press("Enter")
        page.locator(".inspector-compare").click()
        result = page.locator(".inspector-compare-result")
        until(lambda: "compared model keys" in result.inner_text(), "the comparison")
        assert "all 21 compared model keys are the same" in result.inner_text()
        assert "fingerprints equal" in result.inner_text()
        statuses = {}
        for row in result.locator("tr:has(td)").all():
            cells = row.locator("td").all_inner_texts()
            statuses[cells[1]] = cells[0]
        assert sorted(statuses) == model_keys and set(statuses.values()) == {"same"}
        plot = page.locator(".inspector-compare-plot")
        until(lambda: plot.evaluate("img => img.naturalWidth") > 0, "the per-layer plot")


def test_audit_tab_names_the_damaged_key(page, lab: Lab, flipped: Path, tmp_path: Path) -> None:
    with screenshot(page, tmp_path / "audit.png", lab):
        open_in_app(page, flipped)
        tab(page, "Audit")
        page.locator(".inspector-audit").click()
        result = page.locator(".inspector-audit-result")
        until(lambda: "keys with errors" in result.inner_text(), "the audit's findings")
        assert f"keys with errors: {FP8_WEIGHT}" in result.inner_text()
        assert "1 problem (1 error)" in result.inner_text()


CONTRAST = """el => {
  const rgba = c => {
    const v = c.match(/[\\d.]+/g).map(Number);
    return v.length > 3 ? v : [...v, 1];
  };
  let node = el, bg = [255, 255, 255, 1];
  while (node) {
    const c = rgba(getComputedStyle(node).backgroundColor);
    if (c[3] > 0) { bg = c; break; }
    node = node.parentElement;
  }
  const fg = rgba(getComputedStyle(el).color);
  const mix = fg.slice(0, 3).map((v, i) => v * fg[3] + bg[i] * (1 - fg[3]));
  const lum = c => c.map(v => v / 255)
    .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
    .reduce((s, v, i) => s + v * [0.2126, 0.7152, 0.0722][i], 0);
  const [a, b] = [lum(mix), lum(bg.slice(0, 3))].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}"""
# Text that must read in every theme, and the least contrast it may have (WCAG AA: 4.5 for
# text, 3 for the small print of notes).
READABLE = {
    ".inspector-where": 4.5,
    ".inspector-totals div": 4.5,
    ".inspector-findings b": 4.5,
    f"{ROW} span": 4.5,
    ".inspector-entries .inspector-table th": 4.5,
    ".inspector-entries .inspector-table td": 4.5,
    ".inspector-note": 3.0,
}


def theme(page, name: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=name).first.click()
    light = "true" if "Light" in name else "false"
    until(lambda: page.evaluate("document.body.dataset.jpThemeLight") == light, f"{name} theme")


def test_dark_theme_keeps_the_app_readable(
    page, lab: Lab, demo_dir: Path, shots: Path, tmp_path: Path
) -> None:
    with screenshot(page, tmp_path / "dark.png", lab):
        contrasts = {}
        for name in ("JupyterLab Dark", "JupyterLab Light"):
            theme(page, name)  # the app's views are drawn again: open it after
            open_in_app(page, demo_dir / "fp8")
            if name.endswith("Dark"):
                page.locator(".inspector-app").evaluate("app => app.scrollIntoView()")
                page.screenshot(path=shots / "inspector-dark.png")
            for selector, least in READABLE.items():
                ratio = page.locator(selector).first.evaluate(CONTRAST)
                contrasts[name, selector] = ratio
                assert ratio >= least, f"{selector} in {name}: contrast {ratio:.2f} < {least}"
        dark_th = contrasts["JupyterLab Dark", ".inspector-entries .inspector-table th"]
        assert dark_th >= 4.5  # the table headers were white on light grey before


def cursor_key(page) -> str | None:
    """The full key of the row the keyboard cursor is on."""
    return page.locator(f"{ROW}.inspector-cursor").get_attribute("data-key")


NOTEBOOK_STATE = """() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  return [cells.length, cells.findIndex(c => c.classList.contains('jp-mod-active')),
          document.activeElement.classList.contains('inspector-rows')];
}"""


def press(page, key: str, then: Callable[[], object], what: str) -> None:
    """Press ``key`` in the focused tree and wait for the kernel's answer."""
    page.keyboard.press(key)
    until(then, what)


def test_keyboard_drives_the_tree_and_copies_keys(
    page, lab: Lab, demo_dir: Path, tmp_path: Path
) -> None:
    keys = inspector.open(demo_dir / "fp8").keys()
    first = next(k for k in keys if k.startswith("layers."))  # first child, all the way down
    below = {
        ".".join(k.split(".")[:i]) for k in keys if k.startswith("layers.")
        for i in range(1, k.count(".") + 1)
    }
    with screenshot(page, tmp_path / "keys.png", lab):
        open_in_app(page, demo_dir / "fp8")
        page.locator(".inspector-view button", has_text="stored").click()
        until(lambda: "layers" in top_level(page), "stored view: layers at top level")
        closed = len(rows(page))
        notebook = page.evaluate(NOTEBOOK_STATE)
        page.locator(".inspector-rows").focus()
        for _ in range(top_level(page).index("layers") + 1):
            page.keyboard.press("ArrowDown")
        until(lambda: cursor_key(page) == "layers", "the cursor on layers")
        press(page, "ArrowRight", lambda: len(rows(page)) > closed, "layers opened")
        opened = rows(page)[top_level(page).index("layers")]
        assert cursor_key(page) == "layers" and opened.startswith("\u25be layers"), opened
        press(page, "ArrowRight", lambda: cursor_key(page) == "layers.0", "down to layers.0")
        press(page, "ArrowDown", lambda: cursor_key(page) == "layers.1", "on to layers.1")
        press(page, "ArrowLeft", lambda: cursor_key(page) == "layers", "up to the parent")
        press(page, "ArrowLeft", lambda: len(rows(page)) == closed, "layers closed")
        for key in ("a", "b", "j", "k", "ArrowUp", "ArrowDown"):  # JupyterLab's keys too
            page.keyboard.press(key)
        assert cursor_key(page) == "layers"
        leaves = [k for k in keys if k.startswith("layers.")]
        every = closed + len(below) - 1 + len(leaves)
        press(page, "*", lambda: len(rows(page)) == every, "every node below layers open")
        status = page.locator(".inspector-tree-status").inner_text()
        assert f"opened {len(below)} nodes below layers" in status
        for depth in range(1, first.count(".") + 1):
            want = ".".join(first.split(".")[: depth + 1])
            press(page, "ArrowRight", lambda w=want: cursor_key(page) == w, f"down to {want}")
        page.keyboard.press("Enter")
        details = page.locator(".inspector-tensor")
        until(lambda: first in details.inner_text(), f"the details of {first}")
        assert page.locator(f"{ROW}.inspector-selected").get_attribute("data-key") == first
        assert page.evaluate(NOTEBOOK_STATE) == [*notebook[:2], True]  # no shortcut fired
        page.keyboard.press("Control+c")
        until(lambda: page.evaluate("navigator.clipboard.readText()") == first, "the row copied")
        page.evaluate("navigator.clipboard.writeText('')")
        page.locator(".inspector-copy-key").click()
        until(lambda: page.evaluate("navigator.clipboard.readText()") == first, "details copy")
        details.get_by_text(first, exact=True).first.click(click_count=3)  # select the heading
        assert page.evaluate("String(window.getSelection())").strip() == first


# When the statistics table first shows, note whether the histogram is displayed yet.
NUMBERS_FIRST = """() => {
  window.histogramWhenNumbers = undefined;
  const stats = document.querySelector('.inspector-stats');
  const picture = document.querySelector('.inspector-histogram');
  new MutationObserver((_, observer) => {
    if (stats.innerText.includes('std')) {
      observer.disconnect();
      window.histogramWhenNumbers = getComputedStyle(picture).display;
    }
  }).observe(stats, {childList: true, subtree: true, characterData: true});
}"""


def test_stats_shows_the_numbers_before_the_histogram(
    page, lab: Lab, tmp_path: Path
) -> None:
    weight = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(3))
    save_file({"big.weight": weight}, tmp_path / "big.safetensors")
    with screenshot(page, tmp_path / "stats-first.png", lab):
        open_in_app(page, tmp_path / "big.safetensors")
        select_key(page, "big.weight")
        page.evaluate(NUMBERS_FIRST)
        page.locator(".inspector-app button", has_text="Stats").click()
        seen = "window.histogramWhenNumbers"
        until(lambda: page.evaluate(seen) is not None, "the statistics table")
        assert page.evaluate(seen) == "none"  # the numbers are in, the histogram is not yet
        stats = page.locator(".inspector-stats").inner_text()
        shown = dict(re.findall(r"^(\w+)\s+(\S+)$", stats, re.MULTILINE))
        assert shown["max"] == f"{weight.max().item():.6g}"
        image = page.locator(".inspector-histogram")
        until(lambda: image.evaluate("img => img.naturalWidth") > 0 and image.is_visible(),
              "the histogram after the numbers")


def test_errors_show_where_they_happen(page, lab: Lab, demo_dir: Path, tmp_path: Path) -> None:
    top = page.locator(".inspector-app > .inspector-error")  # the app's own box, above the tabs
    with screenshot(page, tmp_path / "errors.png", lab):
        open_in_app(page, demo_dir / "flat")
        tab(page, "Compare")
        page.locator(".inspector-compare-with input").fill(" ")
        page.locator(".inspector-compare").click()
        failures = page.locator(".inspector-tabs .inspector-failure")

        def shown_failures() -> str:
            return " ".join(f.inner_text() for f in failures.all() if f.is_visible())

        until(lambda: "The comparison failed." in shown_failures(), "the error in its panel")
        assert "nothing to compare with" in shown_failures()
        assert top.inner_text().strip() == ""  # shown in the Compare panel only
        tab(page, "Keys")
        assert shown_failures() == ""  # not in the Keys panel
        shown = rows(page)
        missing = tmp_path / "no-such-checkpoint"
        page.locator(".inspector-path input").fill(str(missing))
        page.locator(".inspector-open").click()
        until(lambda: "Opening the checkpoint failed." in top.inner_text(), "the open error")
        assert str(missing) in top.inner_text()
        assert str(demo_dir / "flat") in page.locator(".inspector-where").inner_text()
        assert rows(page) == shown  # the checkpoint open before stays on screen
        tree = page.locator(".inspector-rows").first
        assert top.bounding_box()["y"] < tree.bounding_box()["y"]  # the error above it
