"""Checkpoint files on object stores and web servers (s3://, gs://, hf://, http(s)://), via fsspec.

Reads are exact byte ranges: one ranged GET per range, the length of every answer checked
(a server that ignores Range is an error, never wrong bytes), transient faults (5xx,
timeouts, truncated bodies) retried with backoff. Every store's ranged GETs go through one
guarded HTTP GET (``_get_range``: timeouts, a deadline, a cap on the bytes accepted, no
content encoding); the store's own client only says where the object is (an S3 presigned
URL, GCS's download URL and auth header, the Hub's resolve URL and token).

``prefetch`` fetches the ranges a read is about to need at once, neighbours coalesced,
several concurrently. A zip parse through ``window`` gets the bytes it touches at the start
and the end of the window in one request each, sized by what earlier windows of the same
checkpoint needed; small blocks are kept in a small in-memory cache for the checkpoint's
life (objects are assumed not to change while a checkpoint is open).

One filesystem per checkpoint, built from its storage options in each process that uses
it (s3fs instances are not fork-safe): a storage pickles as its URL and options. The
options are never shown: not in a repr, a message or ``location`` (which also drops
user:password@ and query strings from the URL).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from inspector.errors import (
    CheckpointFileMissingError,
    CorruptCheckpointError,
    ExportError,
    NotACheckpointError,
    RemoteError,
    StorageAccessError,
    UsageError,
    output_exists,
)
from inspector.storage.base import (
    ByteRange,
    IOCounter,
    Kind,
    Listed,
    WindowBase,
    relative_name,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

# URL scheme -> fsspec protocol.
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "hf": "hf", "http": "http",
           "https": "https"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

SMALL_READ = 1 << 16  # window reads below this go through blocks; above it, exact
PART = 1 << 24  # big ranges are fetched in parts of this size, concurrently
CONCURRENCY = 8  # requests in flight at once, per checkpoint
PREFETCH_LIMIT = 1 << 26  # more than this is read range by range (bounded memory)
COALESCE_GAP = 1 << 13  # ranges this close are fetched as one
WHOLE_WINDOW_SLACK = 256  # a window barely larger than its head and tail is fetched whole
PROFILE_LIMIT = 1 << 16  # the most a learnt head or tail block may be
LEARN_READ = 1 << 12  # reads up to this size (a zip's records, not tensor data) teach it
BIG_WINDOW_BLOCK = 1 << 12  # what a big window fetches at least at each end (see _span)
CACHE_BYTES = 1 << 24  # small blocks kept for the checkpoint's life
RETRIES = 3
BACKOFF = 0.2  # seconds before the first retry; doubled each time
# A stalled or trickling server must not hang a read: requests give up connecting after
# CONNECT_SECONDS, waiting for the next bytes after IDLE_SECONDS, and (ranged GETs) in all
# after REQUEST_SECONDS plus a second per MIN_RATE bytes asked for.
CONNECT_SECONDS = 10.0
IDLE_SECONDS = 30.0
REQUEST_SECONDS = 60.0
MIN_RATE = 1 << 16
SIGNED_SECONDS = 3600  # how long an S3 presigned URL for one ranged GET stays valid
# A response may carry at most this many bytes beyond what was asked for (counted as they
# arrive): a server ignoring Range cannot make a few-KB read allocate the whole object.
ACCEPT_MARGIN = 1 << 12

T = TypeVar("T")
# (object path, start, end) spans, and (start, end) pieces of one object.
Spans = list[tuple[str, int, int]]
Pieces = list[tuple[int, int]]


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL this package reads through fsspec (s3, gs, hf, http(s))."""
    match = _URL.match(path) if isinstance(path, str) else None
    return bool(match) and match.group(1).lower() in SCHEMES  # type: ignore[union-attr]


def display_url(url: str) -> str:
    """``url`` as it may be shown: no ``user:password@``, no query string or fragment."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def open_url(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[
    RemoteStorage, str
]:
    """The storage holding ``url`` and the name asked for in it (as ``open_location``): a
    folder is its own storage (``""``), a file a name in its parent folder's."""
    storage = RemoteStorage(url, storage_options)
    kind = storage.kind()
    if kind is None:
        raise NotACheckpointError("no such file or folder", file=storage.location)
    if kind == "dir":
        return storage, ""
    return storage.parent(), storage.basename


class RemoteStorage:
    """A folder on an object store or web server (see :class:`inspector.storage.base.Storage`).

    ``storage_options`` are fsspec's (endpoint_url, key, secret, token, anon, ...), as
    pandas and datasets take them; ``retries`` and ``backoff`` govern our own retries of
    transient faults (clients such as s3fs also retry inside; None: ``RETRIES`` and
    ``BACKOFF``)."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: int | None = None,
        backoff: float | None = None,
    ) -> None:
        if not is_url(url):
            raise UsageError(f"not a URL this package reads: {display_url(str(url))!r} "
                             f"(schemes: {', '.join(sorted(SCHEMES))})")
        scheme = url.split("://", 1)[0].lower()
        parts = urlsplit(url)
        protocol = SCHEMES[scheme]
        if parts.query and protocol not in ("http", "https"):
            raise UsageError(f"{scheme}:// URLs take no query string; use storage_options")
        path = parts.path.rstrip("/")
        if protocol in ("http", "https"):
            base = urlunsplit((scheme, parts.netloc, path, "", ""))
        else:
            base = f"{parts.netloc}{path}".strip("/")
        shared = _Shared(protocol, dict(storage_options or {}),
                         RETRIES if retries is None else retries,
                         BACKOFF if backoff is None else backoff)
        self._setup(shared, base, display_url(url).rstrip("/"), parts.query)
        # A web server may answer a folder URL with 404 (no index page): a trailing slash
        # says it is a folder all the same.
        self._dir_hint = self._is_http and url.split("?", 1)[0].endswith("/")

    def _setup(self, shared: _Shared, base: str, location: str, query: str) -> None:
        self._shared, self._base, self._query = shared, base, query
        self.location = location
        self.io: IOCounter = shared.io
        self._dir_hint = False

    def _at(self, base: str, location: str) -> RemoteStorage:
        """Another folder of the same store, sharing filesystem, counters and caches."""
        other = RemoteStorage.__new__(RemoteStorage)
        other._setup(self._shared, base, location, self._query)
        return other

    def __repr__(self) -> str:
        return f"RemoteStorage({self.location!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "io"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.io = self._shared.io

    # --- names -----------------------------------------------------------------------------
    @property
    def basename(self) -> str:
        return self._base.rstrip("/").rsplit("/", 1)[-1]

    def parent(self) -> RemoteStorage:
        base = self._base.rstrip("/").rsplit("/", 1)[0]
        return self._at(base, self.location.rsplit("/", 1)[0])

    def describe(self, name: str) -> str:
        return f"{self.location}/{name}" if name else self.location

    def check(self, name: object, *, referrer: str, key: str | None = None) -> str:
        parts = relative_name(name, referrer=referrer, key=key)
        return str(parts)

    def _path(self, name: str) -> str:
        """The filesystem path (or URL) of ``name``."""
        if self._shared.protocol in ("http", "https"):
            joined = f"{self._base}/{quote(name)}" if name else self._base
            return f"{joined}?{self._query}" if self._query else joined
        return f"{self._base}/{name}" if name else self._base

    def child(self, name: str) -> RemoteStorage:
        return self._at(f"{self._base}/{name}", self.describe(name))

    def local_path(self, name: str) -> Path | None:
        return None

    # --- what is there ---------------------------------------------------------------------
    def kind(self, name: str = "") -> Kind | None:
        found = self._info(name)
        return None if found is None else found[0]

    def size(self, name: str) -> int:
        found = self._info(name)
        label = self.describe(name)
        if found is None:
            raise CheckpointFileMissingError("is missing", file=label)
        kind, size = found
        if kind != "file":
            raise CorruptCheckpointError("is a directory, not a regular file", file=label)
        if size is None:  # an HTTP listing gives no sizes: ask for this one
            found = self._stat(name)
            size = found[1] if found is not None else None
            if size is None:
                raise StorageAccessError("the server does not tell the file's size", file=label)
            self._shared.infos[self._path(name)] = found
        return size

    def list(self, name: str = "") -> list[tuple[str, Listed]]:
        path = self._path(name)
        listing = self._shared.listings.get(path)
        if listing is None:
            listing = self._list(name)
            self._shared.listings[path] = listing
        return sorted((child, kind) for child, (kind, _) in listing.items())

    def _info(self, name: str) -> tuple[Kind, int | None] | None:
        """(kind, size) of ``name``, from the parent's listing when it was listed."""
        path = self._path(name)
        shared = self._shared
        if path in shared.infos:
            return shared.infos[path]
        if name:
            parent, _, base = name.rpartition("/")
            listing = shared.listings.get(self._path(parent))
            if listing is not None:
                return listing.get(base)
        found = self._stat(name)
        shared.infos[path] = found
        return found

    def _stat(self, name: str) -> tuple[Kind, int | None] | None:
        path = self._path(name)
        try:
            info = self._call(lambda fs: fs.info(path), self.describe(name), "looking it up")
        except CheckpointFileMissingError:
            return ("dir", None) if not name and self._dir_hint else None
        if self._is_http:
            html = str(info.get("mimetype") or "").startswith("text/html")
            return ("dir", None) if html else ("file", info.get("size"))
        kind: Kind = "dir" if info.get("type") == "directory" else "file"
        return kind, (info.get("size") if kind == "file" else None)

    def _list(self, name: str) -> dict[str, tuple[Kind, int | None]]:
        path, label = self._path(name), self.describe(name)
        if self._is_http and self._query:
            # fsspec matches an index page's links against the URL, query and all
            raise StorageAccessError("a folder URL with a query string cannot be listed "
                                     "(a DCP folder needs no listing)", file=label)
        listed = self._call(lambda fs: fs.ls(path, detail=True), label, "listing it")
        prefix = path.split("?", 1)[0].rstrip("/") + "/"
        children: dict[str, tuple[Kind, int | None]] = {}
        for item in listed:
            full = str(item.get("name", ""))
            if self._is_http:
                full = full.split("?", 1)[0]
            elif not full.startswith(prefix):
                full = self._shared.fs._strip_protocol(full)
            if not full.startswith(prefix):
                continue
            child = full[len(prefix):]
            directory = item.get("type") == "directory" or child.endswith("/")
            child = unquote(child.strip("/")) if self._is_http else child.strip("/")
            if not child or "/" in child:
                continue
            kind: Kind = "dir" if directory else "file"
            children[child] = (kind, None if directory else item.get("size"))
        return children

    @property
    def _is_http(self) -> bool:
        return self._shared.protocol in ("http", "https")

    # --- reading ---------------------------------------------------------------------------
    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        size = self.size(name)
        length = size - offset if length is None else length
        _check_range(offset, length, size, self.describe(name))
        return bytes(self._gather(name, offset, length))

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        size = self.size(name)
        _check_range(offset, len(buffer), size, self.describe(name))
        self._gather(name, offset, len(buffer), out=memoryview(buffer).cast("B"))

    def window(self, name: str, offset: int, length: int) -> io.RawIOBase:
        size = self.size(name)
        return _Window(self, name, offset, max(0, min(length, size - offset)))

    def blocks(self, name: str, offset: int, length: int) -> Iterator[memoryview]:
        size = self.size(name)
        _check_range(offset, length, size, self.describe(name))
        spans = iter([(s, min(PART, offset + length - s)) for s in range(offset, offset + length,
                                                                        PART)])
        pool = self._shared.pool()
        ahead: collections.deque = collections.deque()
        for start, n in spans:
            ahead.append(pool.submit(self._gather, name, start, n, parallel=False))
            if len(ahead) >= CONCURRENCY // 2:
                break
        while ahead:
            data = ahead.popleft().result()
            more = next(spans, None)
            if more is not None:
                ahead.append(pool.submit(self._gather, name, more[0], more[1], parallel=False))
            yield data

    @contextlib.contextmanager
    def prefetch(self, ranges: Sequence[ByteRange]) -> Iterator[None]:
        spans = self._coalesced(ranges)
        if not spans or sum(end - start for _, start, end in spans) > PREFETCH_LIMIT:
            yield
            return
        shared = self._shared
        parts = [(path, s, min(s + PART, end)) for path, start, end in spans
                 for s in range(start, end, PART)]
        fetched = _map(shared, lambda p: (p[0], p[1], self._fetch(p[0], p[1], p[2])), parts)
        with shared.lock:
            shared.pinned.extend(fetched)
        try:
            yield
        finally:
            with shared.lock:
                kept = {id(block) for block in fetched}
                shared.pinned = [b for b in shared.pinned if id(b) not in kept]

    def _coalesced(self, ranges: Sequence[ByteRange]) -> Spans:
        """The objects' byte spans that ``ranges`` (those that lie within their object) cover,
        neighbours merged."""
        wanted: dict[str, Pieces] = {}
        for r in ranges:
            storage = r.storage
            if not isinstance(storage, RemoteStorage) or storage._shared is not self._shared:
                continue
            if not (type(r.offset) is int and type(r.length) is int and r.length > 0):
                continue
            try:
                if r.offset < 0 or r.offset + r.length > storage.size(r.name):
                    continue
            except (CheckpointFileMissingError, CorruptCheckpointError):
                continue
            wanted.setdefault(storage._path(r.name), []).append((r.offset, r.offset + r.length))
        spans: Spans = []
        for path, pieces in wanted.items():
            pieces.sort()
            start, end = pieces[0]
            for s, e in pieces[1:]:
                if s - end > COALESCE_GAP:
                    spans.append((path, start, end))
                    start = s
                end = max(end, e)
            spans.append((path, start, end))
        return spans

    def _gather(self, name: str, start: int, length: int, out: memoryview | None = None,
                *, parallel: bool = True) -> memoryview:
        """Bytes ``[start, start+length)`` of ``name``: what blocks in memory hold, the rest
        fetched (big gaps in parts, concurrently when ``parallel``); into ``out`` if given."""
        path = self._path(name)
        result = out if out is not None else memoryview(bytearray(length))
        end, pos = start + length, start
        missing = []
        while pos < end:
            hit = self._shared.block_at(path, pos)
            if hit is not None:
                block_start, data = hit
                n = min(end, block_start + len(data)) - pos
                at = pos - block_start
                result[pos - start: pos - start + n] = data[at: at + n]
                pos += n
                continue
            stop = self._shared.next_block(path, pos, end)
            missing += [(s, min(s + PART, stop)) for s in range(pos, stop, PART)]
            pos = stop

        def fetch(span: tuple[int, int]) -> None:
            data = self._fetch(path, span[0], span[1])
            result[span[0] - start: span[1] - start] = data
            if len(data) <= SMALL_READ:
                self._shared.remember(path, span[0], data)

        if parallel and len(missing) > 1:
            _map(self._shared, fetch, missing)
        else:
            for span in missing:
                fetch(span)
        return result

    def _fetch(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path``: one ranged GET, its length
        checked, transient faults retried."""
        shared = self._shared
        label = self._label(path)
        what = f"reading bytes {start}..{end}"
        for attempt in range(shared.retries + 1):
            last = attempt == shared.retries
            data = self._call(
                lambda fs: _http_range(shared.getter, *_address(shared.protocol, fs, path),
                                       start, end, label),
                label, what)
            if len(data) == end - start:
                return data
            if len(data) > end - start:
                raise StorageAccessError(
                    f"the server ignored the Range request: asked for bytes {start}..{end} "
                    f"({end - start} bytes), got {len(data)} bytes", file=label)
            if last:
                raise StorageAccessError(
                    f"{what}: the server sent {len(data)} of {end - start} bytes (truncated "
                    f"body) in each of {attempt + 1} attempts", file=label)
            time.sleep(shared.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _label(self, path: str) -> str:
        """What to call the object at ``path`` in messages (never with credentials)."""
        relative = path.split("?", 1)[0][len(self._base):].lstrip("/")
        return self.describe(unquote(relative) if self._is_http else relative)

    def _call(self, fn: Callable[[Any], T], label: str, what: str) -> T:
        """``fn(filesystem)``, retried on transient faults; failures as InspectorErrors."""
        shared = self._shared
        for attempt in range(shared.retries + 1):
            try:
                result = fn(shared.fs)
            except RemoteError:
                raise
            except Exception as exc:  # every client has its own errors: sorted out below
                kind, status = _classify(exc)
                shared.io.add(0)
                if kind == "transient" and attempt < shared.retries:
                    time.sleep(shared.backoff * 2**attempt)
                    continue
                raise _failure(kind, status, exc, label, what, attempt + 1) from None
            shared.io.add(len(result) if isinstance(result, bytes) else 0)
            return result
        raise AssertionError("unreachable")

    # --- writing (export targets) --------------------------------------------------------
    def upload(self, local: Path, name: str, *, overwrite: bool) -> str:
        """Store the local file as ``name``; the object appears only when complete (an S3 or
        GCS upload, single or multipart, and a Hub commit are atomic). Returns its URL."""
        if self._is_http:
            raise UsageError("cannot write to http(s):// URLs; use s3://, gs:// or hf://")
        path, label = self._path(name), self.describe(name)
        self._shared.infos.pop(path, None)
        if not overwrite and self._stat(name) is not None:
            raise output_exists(label)
        self._call(lambda fs: fs.put_file(str(local), path), label, "uploading it")
        self._shared.infos.pop(path, None)
        found = self._stat(name)
        if found is None or found[1] != local.stat().st_size:
            raise ExportError(f"upload incomplete: {found[1] if found else 'no'} bytes stored of "
                              f"{local.stat().st_size}", file=label)
        return label

    def exists(self, name: str) -> bool:
        """Whether ``name`` is there now (asked afresh, not from a listing)."""
        self._shared.infos.pop(self._path(name), None)
        return self._stat(name) is not None

    def remove(self, name: str) -> None:
        path = self._path(name)
        self._call(lambda fs: fs.rm_file(path), self.describe(name), "removing it")
        self._shared.infos.pop(path, None)


class _Shared:
    """What a storage and its sub-folders share: the filesystem (one per process), the
    counters, listings, small blocks and the learnt window profile. Pickles as its options."""

    def __init__(self, protocol: str, options: dict[str, Any], retries: int,
                 backoff: float) -> None:
        self.protocol, self.options, self.retries, self.backoff = (
            protocol, options, retries, backoff)
        self._fresh()

    def _fresh(self) -> None:
        self.io = IOCounter()
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self._fs: Any = None
        self._getter: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self.infos: dict[str, tuple[Kind, int | None] | None] = {}
        self.listings: dict[str, dict[str, tuple[Kind, int | None]]] = {}
        self.cache: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self.cached: dict[str, dict[int, bytes]] = {}  # the same blocks, by object
        self.cached_bytes = 0
        self.pinned: list[tuple[str, int, bytes]] = []
        self.head = self.tail = 0  # the learnt profile: how much to fetch at each end
        self.heads: collections.Counter[int] = collections.Counter()
        self.tails: collections.Counter[int] = collections.Counter()

    def __getstate__(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "options": self.options, "retries": self.retries,
                "backoff": self.backoff}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def __repr__(self) -> str:
        return f"<shared {self.protocol} filesystem>"

    @property
    def fs(self) -> Any:
        """This process's filesystem (a forked child builds its own: s3fs is not fork-safe)."""
        if self.pid != os.getpid():
            self.lock = threading.RLock()
            self.pid, self._fs, self._getter, self._pool = os.getpid(), None, None, None
        if self._fs is None:
            with self.lock:
                if self._fs is None:
                    self._fs = _filesystem(self.protocol, self.options)
        return self._fs

    @property
    def getter(self) -> Any:
        """This process's HTTP client for ranged GETs: the filesystem itself over HTTP(S),
        else fsspec's HTTP filesystem (with our timeouts) on the URLs the store's client gives."""
        if self.protocol in ("http", "https"):
            return self.fs
        self.fs  # noqa: B018 (resets the getter in a forked child)
        with self.lock:
            if self._getter is None:
                self._getter = _filesystem("https", {"encoded": True})
            return self._getter

    def pool(self) -> ThreadPoolExecutor:
        from concurrent.futures import ThreadPoolExecutor

        self.fs  # noqa: B018 (resets the pool in a forked child)
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="inspector-fetch")
            return self._pool

    # --- blocks in memory ------------------------------------------------------------------
    def block_at(self, path: str, pos: int) -> tuple[int, bytes] | None:
        with self.lock:
            for p, start, data in self.pinned:
                if p == path and start <= pos < start + len(data):
                    return start, data
            for start, data in self.cached.get(path, {}).items():
                if start <= pos < start + len(data):
                    self.cache.move_to_end((path, start))
                    return start, data
        return None

    def next_block(self, path: str, pos: int, end: int) -> int:
        """Where the first block in memory after ``pos`` begins (``end`` if none before)."""
        with self.lock:
            starts = [s for p, s, _ in self.pinned if p == path and pos < s < end]
            starts += [s for s in self.cached.get(path, {}) if pos < s < end]
        return min(starts, default=end)

    def pinned_cover(self, path: str, start: int, end: int) -> bool:
        """Whether one prefetched block holds all of ``[start, end)``."""
        with self.lock:
            return any(p == path and s <= start and end <= s + len(d) for p, s, d in self.pinned)

    def remember(self, path: str, start: int, data: bytes) -> None:
        with self.lock:
            blocks = self.cached.setdefault(path, {})
            if start in blocks:
                return
            blocks[start] = self.cache[(path, start)] = data
            self.cached_bytes += len(data)
            while self.cached_bytes > CACHE_BYTES:
                (old_path, old_start), old = self.cache.popitem(last=False)
                del self.cached[old_path][old_start]
                self.cached_bytes -= len(old)

    def learn(self, head: int, tail: int) -> None:
        """Count what a closed window's parse touched at its start and end."""
        with self.lock:
            for seen, extent in ((self.heads, head), (self.tails, tail)):
                if 0 < extent <= PROFILE_LIMIT and (extent in seen or len(seen) < 64):
                    seen[extent] += 1
            self.head, self.tail = (
                min(seen.items(), key=lambda item: (-item[1], item[0]))[0] if seen else 0
                for seen in (self.heads, self.tails)
            )

    def extent(self, seen: collections.Counter[int], usual: int, needed: int) -> int:
        """How much of a window's start (or end) to fetch for a read reaching ``needed``
        bytes in: the usual amount when that covers it, else the least amount another
        window used that does; 0 when none did."""
        if needed <= usual:
            return usual
        with self.lock:
            return min((e for e in seen if e >= needed), default=0)


class _Window(WindowBase):
    """Bytes ``[start, start+length)`` of a remote object, read on demand. Small reads near
    the start or the end fetch the block earlier windows needed there (a zip's header and
    its directory); reads elsewhere and big ones are exact. Never reads outside the window."""

    def __init__(self, storage: RemoteStorage, name: str, start: int, length: int) -> None:
        self._storage, self._name, self._start, self._length = storage, name, start, length
        self._pos = self._head = self._tail = 0
        # Reads a prefetch serves teach nothing about what a parse needs.
        self._pinned = storage._shared.pinned_cover(storage._path(name), start, start + length)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        pos = self._pos
        if n >= SMALL_READ:
            self._storage._gather(self._name, self._start + pos, n, out=view[:n])
        else:
            lo, hi = self._span(pos, n)
            data = self._storage._gather(self._name, self._start + lo, hi - lo)
            view[:n] = data[pos - lo: pos - lo + n]
            if n <= LEARN_READ and not self._pinned:
                if pos < self._length / 2:
                    self._head = max(self._head, pos + n)
                else:
                    self._tail = max(self._tail, self._length - pos)
        self._pos += n
        return n

    def _span(self, pos: int, n: int) -> tuple[int, int]:
        """The bytes to fetch for a small read at ``pos``: the window's start or end, as
        much of it as earlier windows' parses used (the usual amount, or the least more
        that covers this read; in a big window at least 1/256 of it, up to 4 KiB: a
        request saved costs more than those bytes), else just the read."""
        shared, length = self._storage._shared, self._length
        if shared.head and shared.tail and length <= shared.head + shared.tail + WHOLE_WINDOW_SLACK:
            return 0, length
        floor = min(BIG_WINDOW_BLOCK, length >> 8)
        if pos < length / 2:
            head = max(shared.extent(shared.heads, shared.head, pos + n), floor)
            return (0, min(head, length)) if head >= pos + n else (pos, pos + n)
        tail = max(shared.extent(shared.tails, shared.tail, length - pos), floor)
        return (max(0, length - tail), length) if tail >= length - pos else (pos, pos + n)

    def close(self) -> None:
        if not self.closed:
            self._storage._shared.learn(self._head, self._tail)
        super().close()


def _check_range(offset: int, length: int, size: int, label: str) -> None:
    if offset < 0 or length < 0 or offset + length > size:
        raise CorruptCheckpointError(
            f"has {size} bytes; bytes {offset}..{offset + length} lie past its end (truncated?)",
            file=label,
        )


def _map(shared: _Shared, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``fn`` over ``items`` on the checkpoint's fetch threads (at most CONCURRENCY at once)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    return list(shared.pool().map(fn, items))


def _filesystem(protocol: str, options: dict[str, Any]) -> Any:
    """A new fsspec filesystem (never fsspec's shared instance: one per checkpoint), with
    our timeouts unless the options set their own."""
    extra = "pip install 'checkpoint-inspector[remote]'"
    try:
        import fsspec

        fs = fsspec.filesystem(protocol, skip_instance_cache=True,
                               **_with_timeouts(protocol, options))
    except ImportError as exc:
        raise UsageError(f"{protocol}:// needs {exc.name or 'fsspec'}: {extra}") from None
    except TypeError as exc:  # an unknown option: its name is in the message, no values
        raise UsageError(f"storage_options not accepted by {protocol}:// ({exc})") from None
    if protocol == "s3":
        fs.retries = 1  # s3fs's own retries (a class attribute, no option) off: see above
    return fs


def _with_timeouts(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with timeouts where they set none: aiohttp's connect and idle-read ones
    over HTTP(S), botocore's for S3, a connect and a whole-call one for GCS (its client
    passes its own to every call, overriding its session's; an upload part, 50 MiB, must
    arrive within it). The Hub's client has its own (10 s); ranged GETs of every store go
    through our HTTP(S) client."""
    if protocol in ("http", "https", "gs"):
        import aiohttp

        if protocol == "gs":  # gcsfs retries a sock_read timeout 6 times, a whole-call one not
            whole = aiohttp.ClientTimeout(total=REQUEST_SECONDS, sock_connect=CONNECT_SECONDS)
            return {"requests_timeout": whole, **options}
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_SECONDS, sock_read=IDLE_SECONDS)
        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", timeout)
        return {**options, "client_kwargs": client}
    if protocol == "s3":
        # one attempt per call in botocore and s3fs: ours (``_call``) retry transient faults,
        # so a stalled server costs RETRIES+1 timeouts, not 5 x 5 x ours
        config = {"connect_timeout": CONNECT_SECONDS, "read_timeout": IDLE_SECONDS,
                  "retries": {"total_max_attempts": 1}, **(options.get("config_kwargs") or {})}
        return {**options, "config_kwargs": config}
    return options


def _address(protocol: str, fs: Any, path: str) -> tuple[str, dict[str, str]]:
    """The URL and headers of a plain HTTP GET of the object at ``path``, from the store's
    own client (nothing is fetched: an S3 URL is presigned locally, the Hub's is built from
    its resolved revision)."""
    if protocol in ("http", "https"):
        return path, {}
    if protocol == "s3":
        return fs.url(path, expires=SIGNED_SECONDS), {}
    if protocol == "gs":
        return fs.url(path), fs._get_headers(None)
    from huggingface_hub.utils import build_hf_headers

    return fs.url(path), build_hf_headers(token=fs.token)


def _http_range(fs: Any, url: str, headers: dict[str, str], start: int, end: int,
                label: str) -> bytes:
    """Bytes ``[start, end)`` of ``url`` in one GET, never accepting more than asked for
    plus ``ACCEPT_MARGIN`` (counted as they arrive, nothing decompressed) nor taking longer
    than the request's deadline."""
    from fsspec.asyn import sync

    return sync(fs.loop, _get_range, fs, url, headers, start, end, label)


async def _get_range(fs: Any, url: str, extra: dict[str, str], start: int, end: int,
                     label: str) -> bytes:
    wanted, cap = end - start, end - start + ACCEPT_MARGIN
    deadline = time.monotonic() + REQUEST_SECONDS + wanted / MIN_RATE
    options = dict(fs.kwargs)
    headers = {**(options.pop("headers", None) or {}), **extra,
               "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, auto_decompress=False,
                           **options) as response:
        fs._raise_not_found_for_status(response, url)
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise RemoteError(f"the server answered bytes {start}..{end} with Content-Encoding: "
                              f"{encoding[:40]!r} (asked for identity); refusing it", file=label)
        declared = response.content_length
        if declared is not None and declared > cap:
            raise RemoteError(_too_much(start, end, f"announced {declared} bytes"), file=label)
        body = bytearray()
        async for piece in response.content.iter_any():
            body += piece
            if len(body) > cap:
                raise RemoteError(_too_much(start, end, f"sent over {cap} bytes"), file=label)
            if time.monotonic() > deadline:
                raise RemoteError(f"reading bytes {start}..{end}: the server sent {len(body)} "
                                  f"bytes in {REQUEST_SECONDS + wanted / MIN_RATE:.0f} s "
                                  "(too slow); giving up", file=label)
    return bytes(body)


def _too_much(start: int, end: int, what: str) -> str:
    return (f"the server ignored the Range request: asked for bytes {start}..{end} "
            f"({end - start} bytes), it {what}; refusing it")


# --- what went wrong, whichever client said it ----------------------------------------------
_TRANSIENT_NAMES = ("Timeout", "PayloadError", "ServerDisconnected", "ConnectionError",
                    "ConnectorError", "ClientOSError", "IncompleteRead", "StreamingError",
                    "ProxyError", "ConnectionClosed", "RemoteProtocolError", "ReadError")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp, botocore, gcsfs, huggingface_hub)."""
    for e in _chain(exc):
        for attr in ("status", "code", "status_code"):
            value = getattr(e, attr, None)
            if type(value) is int and 100 <= value < 600:
                return value
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        else:
            value = getattr(response, "status_code", None)
        if type(value) is int and 100 <= value < 600:
            return value
    return None


def _classify(exc: BaseException) -> tuple[str, int | None]:
    """``("missing" | "denied" | "transient" | "other", HTTP status or None)``."""
    status = _status(exc)
    chain = list(_chain(exc))
    names = [c.__name__ for e in chain for c in type(e).__mro__]
    # fsspec's http info turns a timed-out HEAD into FileNotFoundError: a timeout anywhere
    # in the chain, without a status, is a stalled server, not a missing file.
    timed_out = status is None and any(isinstance(e, TimeoutError) for e in chain)
    if status == 404 or (not timed_out and (
        any(isinstance(e, FileNotFoundError) for e in chain)
        or any(n.endswith("NotFoundError") for n in names)
    )):
        return "missing", status or 404
    if status in (401, 403) or any(isinstance(e, PermissionError) for e in chain) or any(
        str(e).startswith("Forbidden") for e in chain
    ):
        return "denied", status or 403
    if status is not None and (status >= 500 or status in (408, 429)):
        return "transient", status
    # (asyncio's and concurrent.futures' TimeoutErrors are caught by name on Python 3.10)
    if any(isinstance(e, TimeoutError) for e in chain) or any(
        t in n for n in names for t in _TRANSIENT_NAMES
    ):
        return "transient", status
    return "other", status


def _failure(kind: str, status: int | None, exc: BaseException, label: str, what: str,
             attempts: int) -> Exception:
    """The InspectorError for a failed request. Only the exception's class and status are
    shown: client messages can hold a signed URL."""
    http = f"HTTP {status}" if status else type(exc).__name__
    if kind == "missing":
        return CheckpointFileMissingError(f"is missing ({http})", file=label)
    if kind == "denied":
        return StorageAccessError(
            f"access denied ({http}) while {what}: check the credentials in storage_options",
            file=label)
    if kind == "transient":
        timeout = any("Timeout" in c.__name__ for e in _chain(exc) for c in type(e).__mro__)
        cause = "timed out" if timeout and not status else http
        return StorageAccessError(f"{what} failed {attempts} times: {cause}", file=label)
    return StorageAccessError(f"{what} failed: {http}", file=label)
