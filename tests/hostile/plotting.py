"""Class 2, text that reaches matplotlib: keys holding mathtext (``$...$``, unbalanced ``$``,
deeply nested braces, TeX commands) or 200,000 characters, plotted as the app's Stats and
Compare panes plot them. Every figure must draw, fast, with its texts plain (the
characters the key holds, no math parsing) and bounded in length."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase

SECONDS = 10.0  # drawing one figure on a loaded machine; mathtext on a 200k key takes minutes
KEYS = {
    "math": "layers.0.$\\frac{a}{b}$.weight",
    "unbalanced": "layers.0.$x^{.weight",
    "nested": "layers.0.$" + "{" * 400 + "x" + "}" * 400 + "$.weight",
    "deep-sub": "layers.0.$" + "x_" * 2000 + "y$.weight",
    "tex-command": "layers.0.$\\usepackage{evil}\\input{/etc/passwd}$.weight",
    "long": "layers.0." + "w" * 200_000 + ".weight",
    "long-math": "layers.0." + "$x$" * 70_000 + ".weight",
}


def run(args: dict[str, Any], report: Report) -> None:
    import matplotlib.text
    import torch
    from safetensors.torch import save_file

    import inspector
    from inspector.analysis.diff import plot_layer_differences
    from inspector.analysis.stats import histogram, plot_layer_norms
    from inspector.ui.views.plots import LABEL_CHARS, png
    from tests.hostile.guard import guarded

    tmp = Path(args["tmp"])
    key = KEYS[args["key"]]
    second = key.replace("layers.0.", "layers.1.", 1)
    values = {key: torch.linspace(-1, 1, 64), second: torch.linspace(0, 2, 64)}
    save_file(values, str(tmp / "a.safetensors"))
    save_file({k: v * 2 for k, v in values.items()}, str(tmp / "b.safetensors"))
    with guarded(tmp):
        ck = inspector.open(tmp / "a.safetensors")
        figures = {
            "histogram": histogram(ck, key).plot(),
            "norms": plot_layer_norms(ck),
            "compare": plot_layer_differences(
                inspector.diff(ck, tmp / "b.safetensors", progress=False)
            ),
        }
        for name, figure in figures.items():
            began = time.perf_counter()
            data = png(figure)
            seconds = time.perf_counter() - began
            report({"figure": name, "seconds": seconds})
            assert data.startswith(b"\x89PNG") and seconds < SECONDS, (name, seconds)
            texts = [t for t in figure.findobj(matplotlib.text.Text) if t.get_text()]
            assert all(len(t.get_text()) <= LABEL_CHARS for t in texts), name
            assert not any(t.get_usetex() for t in texts), name
            shown = [t.get_text() for t in texts if "layers" in t.get_text() or "$" in t.get_text()]
            assert shown, f"{name}: the key is not shown at all"
            for text in shown:  # the key's own characters, cut with an ellipsis when long
                cut = text.removesuffix("\u2026")
                assert cut in key or cut in key.replace("layers.0.", "layers.*.", 1), text


CASES = {
    f"plotting:{name}": TrustCase("tests.hostile.plotting:run", {"key": name}, seconds=120)
    for name in KEYS
}
