"""The key tree's rows as a keyboard-driven list (arrow keys, Enter, copy), and a button that
copies a key's name: both drawn in the browser, where the clipboard is.

ipywidgets' Select is a native ``<select>``: arrows change its value (each row would open),
left and right do nothing and keys reach JupyterLab's command-mode shortcuts. This list
keeps a keyboard cursor apart from the selection, sends left / right / ``*`` to Python (the
tree decides what they open) and copies a row's full key to the clipboard. Its element
carries ``data-lm-suppress-shortcuts`` and keeps its key events, so JupyterLab's notebook
shortcuts do not fire while it has the focus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anywidget
import traitlets

# A row's value: ("node", prefix) or ("more", parent prefix), as the tree's outline gives.
RowValue = tuple[str, str]
KEY_EVENTS = ("right", "left", "expand_below")

CLIPBOARD = r"""
async function toClipboard(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (err) {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}
"""

ESM = (
    CLIPBOARD
    + r"""
const same = (a, b) => !!a && !!b && a[0] === b[0] && a[1] === b[1];

function render({ model, el }) {
  el.classList.add("inspector-keylist");
  el.setAttribute("data-lm-suppress-shortcuts", "true");
  const box = document.createElement("div");
  box.className = "inspector-rows";
  box.tabIndex = 0;
  box.setAttribute("role", "listbox");
  const said = document.createElement("div");
  said.className = "inspector-copied inspector-note";
  el.append(box, said);
  const options = () => model.get("options");
  const at = () => options().findIndex(([, v]) => same(v, model.get("cursor")));

  const copy = async (key) => {
    await toClipboard(key);
    said.textContent = `copied ${key}`;
  };
  const move = (i) => {
    const rows = options();
    if (!rows.length) return;
    model.set("cursor", rows[Math.max(0, Math.min(rows.length - 1, i))][1]);
    model.save_changes();
  };
  const pick = () => {
    const cursor = model.get("cursor");
    if (cursor) {
      model.set("value", cursor);
      model.save_changes();
    }
  };
  const send = (event) => {
    const cursor = model.get("cursor");
    if (cursor) model.send({ event, row: cursor });
  };
  const page = () => Math.max(1, model.get("rows") - 1);
  const actions = {
    ArrowDown: () => move(at() + 1),
    ArrowUp: () => move(at() < 0 ? 0 : at() - 1),
    PageDown: () => move(at() + page()),
    PageUp: () => move(at() - page()),
    Home: () => move(0),
    End: () => move(options().length - 1),
    Enter: pick,
    " ": pick,
    ArrowRight: () => send("right"),
    ArrowLeft: () => send("left"),
    "*": () => send("expand_below"),
  };

  box.addEventListener("keydown", (event) => {
    event.stopPropagation();  // the notebook's own handlers must not see the tree's keys
    const cursor = model.get("cursor");
    if ((event.ctrlKey || event.metaKey) && event.key === "c") {
      if (cursor && cursor[0] === "node" && !String(window.getSelection())) {
        event.preventDefault();
        copy(cursor[1]);
      }
      return;
    }
    const action = !event.ctrlKey && !event.metaKey && !event.altKey && actions[event.key];
    if (action) {
      event.preventDefault();
      action();
    }
  });

  function draw() {
    box.style.height = `${model.get("rows") * 1.6}em`;
    const value = model.get("value");
    const cursor = model.get("cursor");
    box.replaceChildren(...options().map(([label, v], i) => {
      const row = document.createElement("div");
      row.className = "inspector-row";
      row.setAttribute("role", "option");
      row.dataset.key = v[1];
      row.dataset.kind = v[0];
      if (same(v, value)) {
        row.classList.add("inspector-selected");
        row.setAttribute("aria-selected", "true");
      }
      if (same(v, cursor)) row.classList.add("inspector-cursor");
      const text = document.createElement("span");
      text.textContent = label;
      row.append(text);
      if (v[0] === "node") {
        const button = document.createElement("button");
        button.className = "inspector-row-copy";
        button.title = `copy ${v[1]}`;
        button.textContent = "copy";
        button.tabIndex = -1;
        button.addEventListener("click", (event) => {
          event.stopPropagation();
          copy(v[1]);
        });
        row.append(button);
      }
      row.addEventListener("click", () => {
        move(i);
        pick();
        box.focus();
      });
      return row;
    }));
    const shown =
      box.querySelector(".inspector-cursor") || box.querySelector(".inspector-selected");
    if (shown) shown.scrollIntoView({ block: "nearest" });
  }

  model.on("change:options change:value change:cursor change:rows", draw);
  draw();
}

export default { render };
"""
)


def _row(value: Any) -> RowValue | None:
    """A row value as the browser sends it (a list) made a tuple."""
    return None if value is None else (str(value[0]), str(value[1]))


class KeyList(anywidget.AnyWidget):
    """Rows (``options``: (label, row value) pairs) with one selected (``value``) and a
    keyboard ``cursor``; left, right and ``*`` on the cursor's row go to ``on_key``'s
    callbacks as ``(event, row)``."""

    _esm = ESM
    options = traitlets.Tuple().tag(sync=True)
    value = traitlets.Any(None, allow_none=True).tag(sync=True)
    cursor = traitlets.Any(None, allow_none=True).tag(sync=True)
    rows = traitlets.Int(22).tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._on_key: list[Callable[[str, RowValue], None]] = []
        self.on_msg(self._message)

    @traitlets.validate("value", "cursor")
    def _tuple(self, proposal: dict[str, Any]) -> RowValue | None:
        return _row(proposal["value"])

    def on_key(self, callback: Callable[[str, RowValue], None]) -> None:
        """Call ``callback(event, row)`` for each left / right / expand-below key."""
        self._on_key.append(callback)

    def press(self, event: str, row: RowValue) -> None:
        """What the browser's key does (also for scripts and tests)."""
        if event not in KEY_EVENTS:
            return
        for callback in self._on_key:
            callback(event, row)

    def _message(self, _widget: object, content: dict[str, Any], _buffers: object) -> None:
        row = _row(content.get("row"))
        if row is not None:
            self.press(str(content.get("event")), row)


COPY_ESM = (
    CLIPBOARD
    + r"""
function render({ model, el }) {
  const button = document.createElement("button");
  button.className = "inspector-copy-key jupyter-button";
  const label = () => { button.textContent = model.get("label"); };
  button.addEventListener("click", async () => {
    await toClipboard(model.get("text"));
    button.textContent = "copied";
    setTimeout(label, 1500);
  });
  model.on("change:label", label);
  model.on("change:text", () => { button.disabled = !model.get("text"); });
  button.disabled = !model.get("text");
  label();
  el.append(button);
}

export default { render };
"""
)


class CopyButton(anywidget.AnyWidget):
    """A button that puts ``text`` on the clipboard (disabled while ``text`` is empty)."""

    _esm = COPY_ESM
    text = traitlets.Unicode("").tag(sync=True)
    label = traitlets.Unicode("Copy key").tag(sync=True)
