"""A model file's identity: its SHA-256, remembered per (path, size, mtime) in `<cache root>/identity/`, so a large file
is hashed once; and the hash begun ahead, on a thread of its own, by a start that will need it.

Why ahead: a first start of a 1B model hashes ~800 MB, ~0.7 s of a core, and the load waits for it. Hashing needs
neither torch nor the GIL (hashlib releases it), so `tokenmill serve` begins it before importing torch and the HTTP
side (over a second of imports that hold the GIL), and the load later takes the finished result. Nothing here imports
torch: that is what lets it run first.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path

import platformdirs

HASH_SLICE = 1 << 28  # 256 MiB: a handful of GIL hand-overs for a model file (see _hash_file)

_ahead: dict[str, Future[str]] = {}  # stamp (path, size, mtime) -> the hash begun ahead
_ahead_lock = threading.Lock()


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else Path(platformdirs.user_cache_dir("tokenmill"))


def file_sha256(path: Path, root: Path) -> str:
    """SHA-256 of the file, remembered per (absolute path, size, mtime) so an unchanged file is hashed once; a hash
    begun ahead (hash_ahead) is waited for rather than begun again."""
    stamp = _stamp(path)
    memo = _memo(root, stamp)
    if memo.is_file():
        return memo.read_text().strip()
    with _ahead_lock:
        begun = _ahead.pop(stamp, None)
    digest = begun.result() if begun is not None else _hash_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def hash_ahead(path: Path, root: Path) -> None:
    """Begin hashing `path` on a daemon thread, unless its hash is remembered in `root` already or a file is not
    there (the load reports that): file_sha256 then takes the result."""
    try:
        stamp = _stamp(path)
    except OSError:
        return
    if _memo(root, stamp).is_file():
        return
    with _ahead_lock:
        if stamp in _ahead:
            return
        future: Future[str] = Future()
        _ahead[stamp] = future

    def run() -> None:
        try:
            future.set_result(_hash_file(path))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
            future.set_exception(exc)

    threading.Thread(target=run, name="tokenmill-hash", daemon=True).start()


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def _memo(root: Path, stamp: str) -> Path:
    """Where the hash of the file with this stamp is remembered."""
    return root / "identity" / hashlib.sha1(stamp.encode()).hexdigest()


def _hash_file(path: Path) -> str:
    """The file's SHA-256, from a memory map in slices of HASH_SLICE: hashlib releases the GIL while it hashes a
    slice and takes it again between them. Beside a thread that runs Python (a start builds the tokenizer on one),
    each time the hash wants the GIL back it waits for up to the switch interval (5 ms): read in 4 MiB pieces, the
    1B-shaped file's 800 MB took ~2 s beside the tokenizer against 0.7 s alone."""
    digest = hashlib.sha256()
    if path.stat().st_size == 0:  # mmap refuses an empty file
        return digest.hexdigest()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for at in range(0, len(view), HASH_SLICE):
                digest.update(view[at : at + HASH_SLICE])
        finally:
            view.release()  # before the map closes: it refuses to while a view is exported
    return digest.hexdigest()
