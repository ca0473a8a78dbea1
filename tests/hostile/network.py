"""Class 4, the network: real aiohttp servers on 127.0.0.1 that answer a checkpoint's
metadata truthfully and then misbehave on its ranged GETs: stall (headers never come, or
the body stops), trickle a byte at a time, ignore Range and send a 2 GiB body (announced or
chunked), or gzip/deflate-bomb the answer. The server stands in for a plain web server, for
S3 (its HEAD), for GCS (its JSON object metadata and listing) or for the Hugging Face Hub
(the test Hub stub, with its file downloads replaced). ``inspector.open`` must end, within
the timeouts, in a ``StorageAccessError`` naming the URL without the credentials it was
given, having held no more than a few MB of what the server sent."""

from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path
from typing import Any

from tests.hostile.trust import Report, TrustCase

SECRET = "s3cr3t-pw"
GROWTH = 256 << 20  # peak resident set growth allowed to a case (the bombs are >= 1 GiB)
BOMB = 1 << 30  # what the gzip answer expands to


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _bomb(encoding: str) -> bytes:
    """Zeros compressed: 64 MiB in one deflate stream, or ``BOMB`` bytes as a gzip body of
    members of 64 MiB each (a gzip body may hold several); about 65 KB a member."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    member = packer.compress(bytes(1 << 26)) + packer.flush()
    return member * (BOMB >> 26) if encoding == "gzip" else member


def _app(genuine: bytes, behaviour: str, store: str, tmp: Path):
    from aiohttp import web

    bomb = _bomb(behaviour.split("-")[0]) if behaviour.endswith("-bomb") else b""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "HEAD" or request.path.startswith("/storage/v1/"):
            if behaviour == "stall-head":
                await asyncio.sleep(3600)
            if store == "gs":
                return web.json_response(_gcs_metadata(request, len(genuine)))
            return web.Response(headers={"Content-Length": str(len(genuine)),
                                         "Accept-Ranges": "bytes", "ETag": '"e"',
                                         "Last-Modified": "Thu, 03 Dec 2026 00:00:00 GMT"})
        if behaviour.startswith("stall"):
            await asyncio.sleep(3600)
        if behaviour.endswith("-bomb"):
            encoding = behaviour.split("-")[0]
            return web.Response(body=bomb, status=206, headers={"Content-Encoding": encoding})
        response = web.StreamResponse(status=200 if behaviour.startswith("ignore") else 206)
        if behaviour == "ignore-range":
            response.content_length = 2 << 30
        await response.prepare(request)
        if behaviour == "trickle":
            for _ in range(3600 * 10):
                await response.write(b"\0")
                await asyncio.sleep(0.1)
        if behaviour == "stall-body":
            await response.write(genuine[:4])
            await asyncio.sleep(3600)
        block = bytes(1 << 20)
        for _ in range(2048):  # 2 GiB of zeros, whoever asks
            await response.write(block)
        return response

    if store == "hf":
        return _hub(handle, genuine, tmp)
    app = web.Application()
    app.router.add_route("*", "/{name:.*}", handle)
    return app


def _gcs_metadata(request, size: int) -> dict[str, Any]:
    """GCS's JSON API: the object, or a listing holding it."""
    item = {"kind": "storage#object", "bucket": "bucket", "name": "ckpt/model.safetensors",
            "size": str(size), "generation": "1", "updated": "2026-12-03T00:00:00.000Z"}
    if request.path.endswith("/o"):
        prefix = request.query.get("prefix", "")
        return {"kind": "storage#objects",
                "items": [item] if item["name"].startswith(prefix) else []}
    return item


def _hub(handle, genuine: bytes, tmp: Path):
    """The Hub stub serving repo ``org/ckpt``; its downloads (GET) answered by ``handle``."""
    from tests.fixtures.hub_stub import HubStub

    folder = tmp / "hub"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(genuine)
    stub = HubStub()
    stub.add("org/ckpt", folder)
    truthful = stub.resolve

    async def resolve(request):
        return await (truthful if request.method == "HEAD" else handle)(request)

    stub.resolve = resolve  # type: ignore[method-assign]
    return stub.app()


def run(args: dict[str, Any], report: Report) -> None:
    import torch
    from safetensors.torch import save_file

    import inspector
    from inspector.errors import StorageAccessError
    from inspector.storage import remote
    from tests.fixtures.proxy import LoopThread, serve

    remote.IDLE_SECONDS, remote.REQUEST_SECONDS, remote.CONNECT_SECONDS = 0.5, 1.0, 1.0
    remote.RETRIES, remote.BACKOFF = 1, 0.05
    tmp = Path(args["tmp"])
    save_file({"w": torch.arange(64.0)}, str(tmp / "model.safetensors"))
    behaviour, store = args["behaviour"], args["store"]
    loop = LoopThread("hostile-server")
    genuine = (tmp / "model.safetensors").read_bytes()
    _, base = loop.run(serve(_app(genuine, behaviour, store, tmp)))
    url, options, shown = _address(store, base)
    before = _peak_rss()
    began = time.perf_counter()
    try:
        inspector.open(url, options)
    except StorageAccessError as exc:
        error = exc
    else:
        raise AssertionError("a misbehaving server's file opened")
    seconds = time.perf_counter() - began
    growth = _peak_rss() - before
    report({"seconds": seconds, "growth": growth, "error": str(error)})
    text = f"{error} {error!r} {error.file!r} {error.args!r}"
    assert SECRET not in text and "reader:" not in text, text
    assert shown in str(error), f"{shown!r} not named in: {error}"
    assert args["says"] in str(error), f"{args['says']!r} not said in: {error}"
    assert seconds < args["seconds"], f"{seconds:.1f} s to give up"
    assert growth < GROWTH, f"{growth >> 20} MB more resident while refusing"


def _address(store: str, base: str) -> tuple[str, dict[str, Any], str]:
    """The URL to open on the server at ``base``, its storage options (with a secret), and
    the location errors must name."""
    if store == "http":
        url = base.replace("http://", f"http://reader:{SECRET}@") + "/ckpt/model.safetensors"
        return url, {}, base + "/ckpt"
    if store == "s3":
        return ("s3://bucket/ckpt/model.safetensors",
                {"endpoint_url": base, "key": "AKIAREADER", "secret": SECRET},
                "s3://bucket/ckpt")
    if store == "gs":
        return ("gs://bucket/ckpt/model.safetensors",
                {"endpoint_url": base, "token": "anon", "project": SECRET}, "gs://bucket/ckpt")
    return ("hf://org/ckpt/model.safetensors", {"endpoint": base, "token": f"hf_{SECRET}"},
            "hf://org/ckpt")


_BEHAVIOURS = {  # behaviour: what the error says (given up within 12 s)
    "stall-head": "timed out",
    "stall": "timed out",
    "stall-body": "timed out",
    "trickle": "too slow",
    "ignore-range": "ignored the Range request",
    "ignore-range-chunked": "ignored the Range request",
    "gzip-bomb": "Content-Encoding",
    "deflate-bomb": "Content-Encoding",
}
# Every behaviour over plain HTTP; over the object stores, those their own clients would
# have let through (each store's ranged GETs go through the one guarded GET).
_STORES = {
    "http": list(_BEHAVIOURS),
    "s3": ["stall-head", "stall", "trickle", "ignore-range", "gzip-bomb"],
    "gs": ["stall-head", "stall-body", "ignore-range-chunked", "gzip-bomb"],
    "hf": ["stall", "trickle", "ignore-range", "deflate-bomb"],
}
CASES = {
    f"network:{name}" if store == "http" else f"network:{store}:{name}": TrustCase(
        "tests.hostile.network:run",
        {"behaviour": name, "store": store, "says": _BEHAVIOURS[name], "seconds": 12.0},
        seconds=90,
    )
    for store, names in _STORES.items()
    for name in names
}
