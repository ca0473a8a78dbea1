"""What goes wrong with remote storage, as the servers on 127.0.0.1 inject it: each fault is
an InspectorError naming the URL and the key, transient ones are retried until they pass,
and no credential shows in an error, a repr, the table or the notes. A worker process
builds its own filesystem (s3fs instances are not fork-safe)."""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

import inspector
from inspector.errors import CheckpointFileMissingError, InspectorError, StorageAccessError
from tests.fixtures.servers import CountedServer
from tests.storage.uploads import uploaded

WQ = "layers.0.attention.wq.weight"
RANK1 = "*/fp8/__1_0.distcp"  # WQ has a chunk in each rank's file


def opened(server: CountedServer, demo_dir: Path, **options) -> inspector.Checkpoint:
    ck = inspector.open(uploaded(server, demo_dir / "fp8", "fp8"),
                        {**server.storage_options, **options})
    server.stats.reset()
    return ck


def gets(server: CountedServer, pattern: str = "__1_0.distcp") -> list[int]:
    return [h.status for h in server.stats.hits if h.method == "GET" and pattern in h.path]


def assert_names_url_and_key(exc: InspectorError, ck: inspector.Checkpoint) -> None:
    assert exc.key == WQ and exc.file == f"{ck.location}/__1_0.distcp"
    assert ck.location in str(exc) and repr(WQ) in str(exc)


# --- permanent faults: one clear error, no retries -------------------------------------------
def test_missing_object(remote_server: CountedServer, demo_dir: Path) -> None:
    ck = opened(remote_server, demo_dir)
    remote_server.faults.fail(RANK1, 404, methods=["GET"])
    with pytest.raises(CheckpointFileMissingError, match="is missing") as err:
        ck.read(WQ)
    assert_names_url_and_key(err.value, ck)
    assert gets(remote_server) == [404]
    assert ck.facts(WQ).error == "__1_0.distcp: is missing (HTTP 404)"


def test_access_denied(remote_server: CountedServer, demo_dir: Path) -> None:
    ck = opened(remote_server, demo_dir)
    remote_server.faults.fail(RANK1, 403, methods=["GET"])
    with pytest.raises(StorageAccessError, match="access denied") as err:
        ck.read(WQ)
    assert_names_url_and_key(err.value, ck)
    assert gets(remote_server) == [403]
    remote_server.faults.reset()
    assert ck.facts(WQ).error is None  # a refused request is not damage: reading again works
    assert ck.read(WQ).shape == (64, 64)


def test_server_ignoring_range_never_gives_wrong_bytes(remote_server: CountedServer,
                                                       demo_dir: Path) -> None:
    ck = opened(remote_server, demo_dir)
    remote_server.faults.ignore_range(RANK1)
    with pytest.raises(StorageAccessError, match="ignored the Range request") as err:
        ck.read(WQ)
    assert_names_url_and_key(err.value, ck)
    assert gets(remote_server) == [200]


# --- transient faults: retried, then read as if nothing happened -----------------------------
@pytest.mark.parametrize("fault", ["503", "truncated"])
def test_transient_faults_are_retried(remote_server: CountedServer, demo_dir: Path,
                                      fp8_local: inspector.Checkpoint, fault: str) -> None:
    ck = opened(remote_server, demo_dir)
    if fault == "503":
        remote_server.faults.fail(RANK1, 503, times=2, methods=["GET"])
    else:
        remote_server.faults.truncate(RANK1, keep=100, times=2, methods=["GET"])
    assert torch.equal(ck.read(WQ), fp8_local.read(WQ))
    assert gets(remote_server) == ([503, 503, 206] if fault == "503" else [206, 206, 206])


def test_persistent_server_errors_fail_after_retries(s3_server: CountedServer,
                                                      http_server: CountedServer,
                                                      demo_dir: Path) -> None:
    # the s3 client's own retries off, so the count below is ours: 1 + 3 retries
    single = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
    for server, options in ((s3_server, single), (http_server, {})):
        ck = opened(server, demo_dir, **options)
        server.faults.fail(RANK1, 500, methods=["GET"])
        with pytest.raises(StorageAccessError, match="failed 4 times: HTTP 500") as err:
            ck.read(WQ)
        assert_names_url_and_key(err.value, ck)
        assert gets(server) == [500] * 4


def test_timeouts(http_server: CountedServer, demo_dir: Path,
                  fp8_local: inspector.Checkpoint) -> None:
    quick = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.3)}}
    ck = opened(http_server, demo_dir, **quick)
    http_server.faults.delay(RANK1, 3.0, times=1, methods=["GET"])
    assert torch.equal(ck.read(WQ), fp8_local.read(WQ))  # the retry is answered at once
    http_server.faults.delay(RANK1, 3.0, methods=["GET"])
    began = time.perf_counter()
    with pytest.raises(StorageAccessError, match="failed 4 times: timed out") as err:
        ck.read(WQ)
    assert time.perf_counter() - began < 6
    assert_names_url_and_key(err.value, ck)


def test_truncated_bodies_that_keep_coming(http_server: CountedServer, demo_dir: Path) -> None:
    ck = opened(http_server, demo_dir)
    http_server.faults.truncate(RANK1, keep=100, methods=["GET"])
    with pytest.raises(StorageAccessError, match="failed 4 times") as err:
        ck.read(WQ)
    assert_names_url_and_key(err.value, ck)


def test_faults_during_a_scan(s3_server: CountedServer, demo_dir: Path) -> None:
    """A chunk whose file is gone is shown as unreadable; a refusing server stops the scan."""
    ck = opened(s3_server, demo_dir)
    s3_server.faults.fail(RANK1, 404, methods=["GET"])
    ck.scan(WQ, progress=False)
    assert "is missing" in ck.facts(WQ).error
    s3_server.faults.reset()
    s3_server.faults.fail(RANK1, 403, methods=["GET"])
    with pytest.raises(StorageAccessError, match="access denied"):
        ck.scan(progress=False)


# --- credentials are never shown -------------------------------------------------------------
SECRET_KEY, SECRET = "AKIAEXAMPLESECRET42", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_credentials_never_shown(s3_server: CountedServer, http_server: CountedServer,
                                 demo_dir: Path, tmp_path: Path) -> None:
    options = {**s3_server.storage_options, "key": SECRET_KEY, "secret": SECRET}
    url = uploaded(s3_server, demo_dir / "fp8", "fp8")
    ck = inspector.open(url, options)
    http_url = uploaded(http_server, demo_dir / "fp8", "fp8").replace(
        "http://", f"http://user:{SECRET}@") + f"?token={SECRET}"
    web = inspector.open(http_url)
    assert web.location == f"{http_server.url}/fp8"
    shown = []
    for each in (ck, web):
        each.scan(progress=False)
        shown += [repr(each), each.location, each.describe_layout(), each.table().to_string(),
                  str(each.records()), repr(each.source.storage)]
    for server, each in ((s3_server, ck), (http_server, web)):
        server.faults.fail(RANK1, 403, methods=["GET"])
        with pytest.raises(InspectorError) as err:
            each.read(WQ)
        shown += [str(err.value), repr(err.value), str(err.value.__cause__)]
        server.faults.reset()
    result = inspector.export(ck, tmp_path / "out", progress=False)
    shown += [result.summary(), (tmp_path / "out" / "model.safetensors").read_bytes()[:4096]
              .decode("latin-1")]
    for text in shown:
        assert SECRET_KEY not in text and SECRET not in text, text


# --- processes -----------------------------------------------------------------------------
def _digest_in_child(ck: inspector.Checkpoint, queue: multiprocessing.Queue) -> None:
    tensor = ck.read(WQ)
    queue.put((hashlib.sha256(tensor.numpy().tobytes()).hexdigest(), ck.io.requests))


def test_worker_processes_build_their_own_filesystem(
    s3_server: CountedServer, demo_dir: Path, fp8_local: inspector.Checkpoint
) -> None:
    expected = hashlib.sha256(fp8_local.read(WQ).numpy().tobytes()).hexdigest()
    ck = opened(s3_server, demo_dir)
    ck.read("norm.weight")  # the parent's s3fs instance (and its event loop thread) exist now
    parent_fs = ck.source.storage._shared.fs
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_digest_in_child, args=(ck, queue))
    child.start()
    digest, requests = queue.get(timeout=60)
    child.join(timeout=60)
    assert (child.exitcode, digest) == (0, expected) and requests >= 1
    assert ck.source.storage._shared.fs is parent_fs  # the parent keeps its own

    # A fresh interpreter: the checkpoint pickles as URL + storage options, not the fs.
    blob = pickle.dumps(ck)
    assert b"S3FileSystem" not in blob
    code = (
        "import hashlib, pickle, sys\n"
        "ck = pickle.loads(sys.stdin.buffer.read())\n"
        f"print(hashlib.sha256(ck.read({WQ!r}).numpy().tobytes()).hexdigest())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == expected
