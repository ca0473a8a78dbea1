"""``import inspector`` stays cheap: no torch, pandas or ipywidgets until they are used."""

from __future__ import annotations

import json

from tests.conftest import run_python


def test_import_is_lazy() -> None:
    code = (
        "import json, sys, inspector\n"
        "print(json.dumps([m for m in ('torch', 'pandas', 'ipywidgets') if m in sys.modules]))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
