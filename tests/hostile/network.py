"""Class 4, the network: real aiohttp servers on 127.0.0.1 that answer a checkpoint's HEAD
truthfully and then misbehave on its ranged GETs: stall (headers never come, or the body
stops), trickle a byte at a time, ignore Range and send a 2 GiB body (announced or chunked),
or gzip/deflate-bomb the answer. ``inspector.open`` must end, within the timeouts, in a
``StorageAccessError`` naming the URL without the credentials it was given, having held
no more than a few MB of what the server sent."""

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


def _app(genuine: bytes, behaviour: str):
    from aiohttp import web

    bomb = _bomb(behaviour.split("-")[0]) if behaviour.endswith("-bomb") else b""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "HEAD":
            if behaviour == "stall-head":
                await asyncio.sleep(3600)
            return web.Response(headers={"Content-Length": str(len(genuine)),
                                         "Accept-Ranges": "bytes"})
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

    app = web.Application()
    app.router.add_route("*", "/{name:.*}", handle)
    return app


def run(args: dict[str, Any], report: Report) -> None:
    import torch
    from safetensors.torch import save_file

    import inspector
    from inspector.errors import StorageAccessError
    from inspector.storage import remote
    from tests.fixtures.proxy import LoopThread, serve

    remote.IDLE_SECONDS, remote.REQUEST_SECONDS, remote.CONNECT_SECONDS = 0.5, 1.0, 1.0
    tmp = Path(args["tmp"])
    save_file({"w": torch.arange(64.0)}, str(tmp / "model.safetensors"))
    behaviour = args["behaviour"]
    loop = LoopThread("hostile-server")
    _, base = loop.run(serve(_app((tmp / "model.safetensors").read_bytes(), behaviour)))
    url = base.replace("http://", f"http://reader:{SECRET}@") + "/ckpt/model.safetensors"
    shown = base + "/ckpt"
    before = _peak_rss()
    began = time.perf_counter()
    try:
        inspector.open(url)
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


_BEHAVIOURS = {  # behaviour: (what the error says, seconds it may take to give up)
    "stall-head": ("timed out", 12.0),
    "stall": ("timed out", 12.0),
    "stall-body": ("timed out", 12.0),
    "trickle": ("too slow", 12.0),
    "ignore-range": ("ignored the Range request", 12.0),
    "ignore-range-chunked": ("ignored the Range request", 12.0),
    "gzip-bomb": ("Content-Encoding", 12.0),
    "deflate-bomb": ("Content-Encoding", 12.0),
}
CASES = {
    f"network:{name}": TrustCase(
        "tests.hostile.network:run", {"behaviour": name, "says": says, "seconds": seconds},
        seconds=90,
    )
    for name, (says, seconds) in _BEHAVIOURS.items()
}
