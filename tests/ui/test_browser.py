"""The app in a real browser: JupyterLab runs inspect.ipynb in headless Chromium, a user clicks.

Skipped when chromium or playwright is missing, except in CI (``CI=true``), where that
fails. Every test saves a screenshot under its own tmp folder and names it (and the server
log) when it fails; the Stats test's picture of the whole app, under the module's
``browser-shots`` folder, is the one in docs/inspector.png.
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
from safetensors.torch import load_file

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
        tab = browser.new_page(viewport=VIEWPORT)
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
            page.wait_for_selector(".inspector-tree option", timeout=KERNEL_TIMEOUT / attempts)
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
    texts = page.locator(".inspector-tree select option").all_inner_texts()
    return [t.replace("\xa0", " ") for t in texts]


def top_level(page) -> list[str]:
    """The names of the tree's unindented rows."""
    return [r.split()[1] for r in rows(page) if not r.startswith(" ")]


def pick(page, name: str) -> None:
    """Select the first tree row whose name is ``name``."""
    names = [r.split()[1] for r in rows(page)]
    page.locator(".inspector-tree select").select_option(index=names.index(name))


def select_key(page, key: str) -> None:
    """Filter the tree (glob) to exactly ``key`` in the stored view and select its leaf."""
    page.locator(".inspector-view button", has_text="stored").click()
    page.locator(".inspector-filter-mode select").select_option("glob")
    box = page.locator(".inspector-filter input")
    box.fill(key)
    box.press("Enter")
    depth = key.count(".")
    until(lambda: len(rows(page)) == depth + 1, f"the tree filtered down to {key}")
    page.locator(".inspector-tree select").select_option(index=depth)
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
    page.set_viewport_size(TALL)  # the whole app, plots included, for docs/inspector.png
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
    """Type ``path`` into the app's path box and press Open; wait for its tree."""
    box = page.locator(".inspector-path input")
    box.fill(str(path))
    box.press("Enter")
    page.locator(".inspector-open").click()
    until(lambda: str(path) in page.locator(".inspector-where").inner_text(), f"{path} open")
    page.wait_for_selector(".inspector-tree option")


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
    ".inspector-tree select": 4.5,
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
