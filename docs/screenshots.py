"""The README's pictures of the app: docs/inspector-light.png and docs/inspector-dark.png.

Builds the demo checkpoints in a temporary folder, starts JupyterLab there (as the browser
tests do: Debian's chromium driven by playwright), opens the FP8 demo, selects an FP8 weight
and runs Stats, then takes the app in JupyterLab's light and dark themes. The PNGs are
reduced to 256 colours so each stays well under 300 KB.

    .venv/bin/python docs/screenshots.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import nbformat
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inspector.demo import build_demo  # noqa: E402
from tests.fixtures.lab import CHROMIUM, CHROMIUM_ARGS, start_lab  # noqa: E402

KEY = "layers.0.attention.wq.weight"
VIEWPORT = {"width": 1440, "height": 2600}
TIMEOUT = 90_000
# Outputs shown before a run are marked, so that only the new one is waited for and taken.
OLD_OUTPUT = "document.querySelectorAll('.jp-OutputArea-output').forEach(o => o.dataset.old = 1)"
NEW_OUTPUT = ".jp-OutputArea-output:not([data-old])"
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
CELL = """import inspector
app = inspector.Inspector({path!r})
app.tree.select({key!r})
app.tensor.show_stats()
app"""


def notebook(folder: Path, demo: Path) -> str:
    """A one-cell notebook that shows the app on the FP8 demo with a weight's Stats."""
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(CELL.format(path=str(demo / "fp8"), key=KEY))]
    nbformat.write(book, folder / "screenshots.ipynb")
    return "screenshots.ipynb"


def theme(page, name: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=name).first.click()
    light = "true" if "Light" in name else "false"
    page.wait_for_function(f"document.body.dataset.jpThemeLight === '{light}'")


def shoot(page, path: Path) -> None:
    """The app's output area only, in 256 colours."""
    page.wait_for_function(
        "[...document.querySelectorAll('.inspector-histogram, .inspector-norms')]"
        ".every(img => img.naturalWidth > 0)",
        timeout=TIMEOUT,
    )
    time.sleep(0.5)  # the last images are drawn
    page.locator(NEW_OUTPUT).first.screenshot(path=path)
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_demo(work / "demo")
        (work / "lab").mkdir()
        name = notebook(work / "lab", work / "demo")
        lab = start_lab(work / "lab", work / "state", {})
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, args=CHROMIUM_ARGS
                )
                page = browser.new_page(viewport=VIEWPORT)
                page.set_default_timeout(TIMEOUT)
                lab.start_kernel(name)
                page.goto(lab.url(name))
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                for label, theme_name in THEMES.items():
                    theme(page, theme_name)
                    page.evaluate(OLD_OUTPUT)
                    page.locator(".jp-Cell .cm-content").first.click()
                    page.keyboard.press("Control+Enter")
                    page.wait_for_selector(f"{NEW_OUTPUT} .inspector-stats table")
                    shoot(page, ROOT / "docs" / f"inspector-{label}.png")
                browser.close()
        finally:
            lab.stop()


if __name__ == "__main__":
    main()
