"""Checkpoints uploaded once per test server (uncounted), for the remote tests."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.servers import CountedServer

# Where each backend keeps test data: a bucket, the server's root, a repo.
HOME = {"s3": "remote-tests/", "gs": "remote-tests/", "http": "", "hf": "remote/tests/"}


def uploaded(server: CountedServer, local: Path, name: str) -> str:
    """The URL of ``local`` (a file or folder) stored as ``name`` on ``server``, uploaded on
    first use in the session. Tests that change what they read upload under a new name."""
    done = server.__dict__.setdefault("_uploads", {})
    if name in done and not _still_there(server, name):
        del done[name]
    if name not in done:
        dest = HOME[server.scheme] + name
        local = Path(local)
        done[name] = (
            server.put_folder(local, dest) if local.is_dir() else server.put_bytes(
                dest, local.read_bytes())
        )
    return done[name]


def shard_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.distcp"))


def _still_there(server: CountedServer, name: str) -> bool:
    """moto keeps buckets in process-wide state, and any S3 server stopping resets it (as
    tests of the servers themselves do): ask the backend itself, uncounted."""
    if server.scheme != "s3":
        return True
    bucket, prefix = (HOME["s3"] + name).split("/", 1)
    try:
        listed = server._client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except Exception:  # NoSuchBucket after a reset
        return False
    return listed.get("KeyCount", 0) > 0
