"""The Jupyter app on a remote checkpoint: the path box takes URLs, the constructor takes
storage options, the export panel's default output is a local folder."""

from __future__ import annotations

from pathlib import Path

from inspector.ui.widgets import Inspector
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded


def test_app_opens_urls_with_storage_options(s3_server: CountedServer, demo_dir: Path) -> None:
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    app = Inspector(url, storage_options=s3_server.storage_options)
    assert app.ck is not None and app.ck.location == url
    assert app.export.out.value == str(Path("exports") / "fp8")
    app.path.value = url + "-missing"
    app.open_button.click()
    assert "no such file or folder" in app.errors.value
    app.path.value = url
    app.open_button.click()
    assert app.ck.location == url and len(app.ck.keys()) == 347
    app.close()
