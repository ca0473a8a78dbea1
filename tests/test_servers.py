"""The test servers themselves (tests/fixtures/servers.py): exact ranged reads counted at the
server, listings, every fault as a client sees it, and clean stops. Real clients (s3fs,
gcsfs, fsspec http, huggingface_hub's HfFileSystem) against real servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import aiohttp
import pytest
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

from tests.fixtures.servers import SERVERS, CountedServer
from tests.fixtures.traffic import Tally

DATA = bytes(range(256)) * 64 + b"an odd tail"  # 16,395 bytes
START, END = 1000, 5000
# Where each backend keeps the test file: bucket, folder or repo, then "dir/blob.bin".
HOME = {"s3": "fixture-bucket/", "gs": "fixture-bucket/", "http": "", "hf": "fixture/repo/"}
# HfFileSystem reads ahead a 5 MiB block unless told not to; the others read exactly.
EXACT = {"hf": {"cache_type": "none"}}


def upload(server: CountedServer, rel: str = "dir/blob.bin") -> tuple[object, str]:
    """``DATA`` stored at ``rel``, its info read once (caches warm), stats cleared."""
    url = server.put_bytes(HOME[server.scheme] + rel, DATA)
    fs = server.filesystem()
    assert fs.info(url)["size"] == len(DATA)
    server.stats.reset()
    return fs, url


def cat(server: CountedServer, fs, url: str, start: int = START, end: int = END) -> bytes:
    return fs.cat_file(url, start=start, end=end, **EXACT.get(server.scheme, {}))


def served_path(server: CountedServer) -> str:
    (hit,) = server.stats.hits
    return hit.path


# --- exact ranged reads and listings ---------------------------------------------------------
def test_ranged_read_is_one_exact_request(remote_server: CountedServer) -> None:
    fs, url = upload(remote_server)
    assert cat(remote_server, fs, url) == DATA[START:END]
    (hit,) = remote_server.stats.hits
    assert (hit.method, hit.status, hit.range) == ("GET", 206, f"bytes={START}-{END - 1}")
    assert remote_server.stats.bytes == hit.sent == END - START
    assert remote_server.stats.by_method == {"GET": Tally(1, END - START)}
    assert remote_server.stats.by_path == {hit.path: Tally(1, END - START)}
    assert hit.path.endswith("dir/blob.bin")
    remote_server.stats.reset()
    assert (remote_server.stats.requests, remote_server.stats.bytes) == (0, 0)


def test_default_hf_open_reads_ahead_to_the_end(hf_server: CountedServer) -> None:
    """Why the tests pass cache_type="none" on hf://: the default block reads ahead."""
    fs, url = upload(hf_server)
    assert fs.cat_file(url, start=START, end=END) == DATA[START:END]
    assert hf_server.stats.bytes == len(DATA) - START


def test_listing_and_info(remote_server: CountedServer) -> None:
    remote_server.put_bytes(HOME[remote_server.scheme] + "dir/sub/other.bin", b"12345")
    fs, url = upload(remote_server, "dir/blob.bin")
    folder = url.rsplit("/", 1)[0]
    listed = {fs._strip_protocol(e["name"]).rstrip("/").rsplit("/", 1)[1]: e
              for e in fs.ls(folder, detail=True)}
    assert sorted(listed) == ["blob.bin", "sub"]
    assert fs.info(url)["size"] == len(DATA)
    if remote_server.scheme != "http":  # an HTML index cannot tell a folder from a file
        assert listed["sub"]["type"] == "directory"
        assert listed["blob.bin"]["size"] == len(DATA)


def test_hf_recursive_find_and_missing_entries(hf_server: CountedServer) -> None:
    hf_server.put_bytes("fixture/repo/dir/sub/other.bin", b"12345")
    fs, _ = upload(hf_server, "dir/blob.bin")
    assert fs.find("fixture/repo") == ["fixture/repo/dir/blob.bin",
                                       "fixture/repo/dir/sub/other.bin"]
    with pytest.raises(FileNotFoundError):
        fs.info("fixture/repo/dir/missing.bin")
    with pytest.raises(FileNotFoundError, match="repository not found"):
        fs.ls("fixture/no-such-repo")
    outside = f"{hf_server.url}/fixture/repo/resolve/main/..%2F..%2F..%2Fetc%2Fpasswd"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(outside, timeout=10)
    assert (err.value.code, err.value.headers["X-Error-Code"]) == (404, "EntryNotFound")


# --- faults as clients see them --------------------------------------------------------------
# On hf:// a file missing at read time is not a FileNotFoundError (only info/ls translate).
NOT_FOUND = {"s3": FileNotFoundError, "gs": FileNotFoundError, "http": FileNotFoundError,
             "hf": EntryNotFoundError}
FORBIDDEN = {"s3": PermissionError, "gs": OSError, "http": aiohttp.ClientResponseError,
             "hf": HfHubHTTPError}


@pytest.mark.parametrize("status", [404, 403])
def test_error_status_is_raised_without_retry(remote_server: CountedServer, status: int) -> None:
    fs, url = upload(remote_server)
    rule = remote_server.faults.fail("*/dir/blob.bin", status)
    expected = (NOT_FOUND if status == 404 else FORBIDDEN)[remote_server.scheme]
    with pytest.raises(expected):
        cat(remote_server, fs, url)
    (hit,) = remote_server.stats.hits
    assert (hit.status, rule.hits) == (status, 1)


def test_transient_503_is_retried_by_cloud_clients(remote_server: CountedServer) -> None:
    """s3fs, gcsfs and HfFileSystem retry a 503 and get the data; fsspec http does not."""
    fs, url = upload(remote_server)
    remote_server.faults.fail("*/dir/blob.bin", 503, times=1)
    if remote_server.scheme == "http":
        with pytest.raises(aiohttp.ClientResponseError) as err:
            cat(remote_server, fs, url)
        assert err.value.status == 503
        assert [h.status for h in remote_server.stats.hits] == [503]
        return
    assert cat(remote_server, fs, url) == DATA[START:END]
    assert [h.status for h in remote_server.stats.hits] == [503, 206]


def test_persistent_500_fails_after_the_clients_retries(s3_server: CountedServer) -> None:
    fs, url = upload(s3_server)
    fs = s3_server.filesystem(config_kwargs={"retries": {"total_max_attempts": 2}})
    s3_server.faults.fail("*/dir/blob.bin", 500)
    with pytest.raises(OSError, match="injected fault"):
        cat(s3_server, fs, url)
    assert [h.status for h in s3_server.stats.hits] == [500, 500]


def test_transient_fault_matches_only_its_methods_and_count(
    http_server: CountedServer,
) -> None:
    fs, url = upload(http_server)
    get_once = http_server.faults.fail("*/dir/blob.bin", 404, times=1, methods=["GET"])
    assert fs.info(url)["size"] == len(DATA)
    with pytest.raises(FileNotFoundError):
        cat(http_server, fs, url)
    assert cat(http_server, fs, url) == DATA[START:END]
    assert get_once.hits == 1
    assert [(h.method, h.status) for h in http_server.stats.hits] == [
        ("HEAD", 200), ("GET", 404), ("GET", 206)]


def test_delay_makes_a_client_time_out(http_server: CountedServer, s3_server: CountedServer,
                                       ) -> None:
    http_fs, http_url = upload(http_server)
    http_fs = http_server.filesystem(client_kwargs={"timeout": aiohttp.ClientTimeout(total=0.3)})
    s3_fs, s3_url = upload(s3_server)
    s3_fs = s3_server.filesystem(
        config_kwargs={"read_timeout": 0.3, "retries": {"total_max_attempts": 1}})
    s3_fs.retries = 1
    for server, fs, url in [(http_server, http_fs, http_url), (s3_server, s3_fs, s3_url)]:
        rule = server.faults.delay("*/dir/blob.bin", 5.0)
        began = time.perf_counter()
        with pytest.raises((TimeoutError, OSError)):
            cat(server, fs, url)
        assert time.perf_counter() - began < 3.0
        assert rule.hits == 1
        server.faults.reset()
        assert cat(server, fs, url) == DATA[START:END]


def test_truncated_body_is_detected(remote_server: CountedServer) -> None:
    """Fewer body bytes than Content-Length: fsspec http raises; the cloud clients retry."""
    fs, url = upload(remote_server)
    remote_server.faults.truncate("*/dir/blob.bin", keep=100, times=1)
    if remote_server.scheme == "http":
        with pytest.raises(aiohttp.ClientPayloadError):
            cat(remote_server, fs, url)
        assert [h.sent for h in remote_server.stats.hits] == [100]
        return
    assert cat(remote_server, fs, url) == DATA[START:END]
    assert [h.sent for h in remote_server.stats.hits] == [100, END - START]


def test_ignored_range_returns_the_whole_file_unnoticed(remote_server: CountedServer) -> None:
    """No client checks for 206: a reader must compare the length it got."""
    fs, url = upload(remote_server)
    remote_server.faults.ignore_range("*/dir/blob.bin", times=1)
    assert cat(remote_server, fs, url) == DATA
    (hit,) = remote_server.stats.hits
    assert (hit.status, hit.sent) == (200, len(DATA))
    assert cat(remote_server, fs, url) == DATA[START:END]


# --- the servers' own lifetime ---------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_server_binds_loopback_and_stops_cleanly(kind: str) -> None:
    threads = set(threading.enumerate())
    env = dict(os.environ)
    with SERVERS[kind]() as server:
        for url in (server.url, server.upstream):
            assert urlsplit(url).hostname == "127.0.0.1"
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(server.url + "/", timeout=10).close()
        assert server.stats.requests == 1
        process = getattr(server, "process", None)
    assert dict(os.environ) == env
    for url in (server.url, server.upstream):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=2)
    if process is not None:
        assert process.poll() is not None
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) - threads == set()
