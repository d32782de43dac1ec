"""Prefix-cache blocks kept past the live KV cache: a RAM tier, then a disk tier that outlives the process.

The live cache (kv_cache.py) remembers a full block of prompt or output tokens by its chained SHA-256, until the block
is handed out again. With tiers, an evicted block's KV is copied out first, into RAM; when the RAM budget is spent the
least recently used entries go. With a disk tier every block the live cache registers is also written to a file, by a
background thread, so that a restart (a kill -9 included) finds what was written before it. A new prompt's prefix is
matched in the live cache, then block by block in RAM, then on disk; each block found is copied into a fresh live
block instead of being computed, and counts as cached (`usage.prompt_tokens_details.cached_tokens`).

Keys. The tiers key a block by SHA-256 of the engine's format (the model's fingerprint, the kernels' build, the KV
dtype and shapes, the block size) and the block's chain hash (which starts from the request's `cache_salt`): a block
written for another model or another KV format is never found for this one, and two salts never share.

Files: `<dir>/<format key, 16 hex>/<block key>.kvb`, a header (magic, version, format key, block key, payload length,
its XXH3-64 checksum) and the block's KV, written to a temporary name and renamed into place, so that a reader finds
a whole file or none. A file that is short, fails its checksum or names another format or key is deleted where it is
found and counts as a miss. At start the folder is listed, temporary files a killed process left are removed, and the
budget is enforced, least recently written out first; while running, each write enforces it. A write that fails (a full or
read-only disk) turns the disk tier off with one warning: requests carry on with RAM alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tokenmill.kernels import ops

log = logging.getLogger(__name__)

MAGIC = b"TMKV"
VERSION = 1
HEADER = struct.Struct("<4sI32s32sQQ")  # magic, version, format key, block key, payload bytes, its XXH3-64
SUFFIX = ".kvb"
WRITE_QUEUE = 256  # blocks waiting for the disk writer; past this a block is not written (counted, never waited for)


@dataclass
class TierStats:
    """What the tiers did since start (counters) and hold now (sizes), for /stats and /metrics."""

    ram_bytes: int = 0
    ram_blocks: int = 0
    ram_capacity_bytes: int = 0
    disk_bytes: int = 0
    disk_blocks: int = 0
    disk_capacity_bytes: int = 0  # 0: no disk tier, or it was turned off by a failed write
    ram_hits: int = 0  # blocks brought back from each tier into the live cache
    disk_hits: int = 0
    ram_saved: int = 0  # blocks copied out of the live cache into RAM as they were evicted
    disk_written: int = 0
    disk_write_dropped: int = 0  # blocks not written: the writer was behind
    ram_evictions: int = 0
    disk_evictions: int = 0
    disk_discarded: int = 0  # files found damaged, or of another format, and deleted
    bytes_to_ram: int = 0
    bytes_from_ram: int = 0
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0


class BlockCopier:
    """Whole blocks of the live cache as flat byte payloads, one tensor each: every layer's keys, then its values.
    A block of a layer's keys (or values) is one region of the cache tensor, so a payload is 2 x layers regions,
    all moved in one call (ops.copy_regions)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        tensors = [t for pair in kv_caches for t in pair]
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("the KV cache tensors must be contiguous")
        self.caches = kv_caches  # kept alive as long as the addresses below are used
        k0 = tensors[0]
        self.region = block_size * k0[0].numel() * k0.element_size()  # one layer's keys (or values) of one block
        self.planes = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)  # (2 x layers,)
        self.nbytes = len(tensors) * self.region

    def _in_cache(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64).unsqueeze(1) * self.region + self.planes  # (n, 2 x layers)

    def _in_payloads(self, payloads: list[torch.Tensor]) -> torch.Tensor:
        if any(p.numel() != self.nbytes or p.dtype != torch.uint8 or not p.is_contiguous() for p in payloads):
            raise ValueError(f"a block's payload is {self.nbytes} contiguous bytes")
        starts = torch.tensor([p.data_ptr() for p in payloads], dtype=torch.int64).unsqueeze(1)
        return starts + torch.arange(len(self.planes), dtype=torch.int64) * self.region  # (n, 2 x layers)

    def read(self, blocks: list[int]) -> list[torch.Tensor]:
        """Each block's payload, a copy of its own."""
        payloads = [torch.empty(self.nbytes, dtype=torch.uint8) for _ in blocks]
        ops.copy_regions(self._in_cache(blocks), self._in_payloads(payloads), self.region)
        return payloads

    def write(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        """Each block's slots from its payload, as read() gave it."""
        ops.copy_regions(self._in_payloads(payloads), self._in_cache(blocks), self.region)


class RamTier:
    """Block payloads in memory, least recently used out first past `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> torch.Tensor | None:
        payload = self.entries.get(key)
        if payload is not None:
            self.entries.move_to_end(key)
        return payload

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        size = payload.numel()
        if size > self.capacity:
            return
        self.entries[key] = payload
        self.nbytes += size
        while self.nbytes > self.capacity:
            _, dropped = self.entries.popitem(last=False)
            self.nbytes -= dropped.numel()
            self.evictions += 1


class DiskTier:
    """Block payloads in files of one format's folder, written by a background thread, least recently used out first
    past `capacity` bytes. The index (key → file size) is shared with the engine's thread under a lock."""

    def __init__(self, root: Path, format_key: bytes, capacity: int) -> None:
        self.format_key = format_key
        self.capacity = capacity
        self.folder = root / format_key.hex()[:16]
        self.index: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.enabled = True
        self.written = self.dropped = self.evictions = self.discarded = 0
        self.written_bytes = 0  # payload bytes of the blocks written
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(WRITE_QUEUE)
        self._writer: threading.Thread | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._fail(exc)
            return
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """The folder as a killed or earlier process left it: temporary files of processes that are gone removed (a
        replica sharing the folder may be writing its own), the rest indexed oldest first, and the budget enforced."""
        found = []
        for entry in os.scandir(self.folder):
            name = entry.name
            if not name.endswith(SUFFIX):
                if name.endswith(".tmp") and not _writer_alive(name):
                    _unlink(Path(entry.path))
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 32:
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.nbytes += size
        with self._lock:
            self._enforce_budget()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return self.enabled and key in self.index

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Queue a block to be written; dropped (and counted) when the writer is behind."""
        if not self.enabled:
            return
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
                return
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            self.dropped += 1

    def get(self, key: bytes, nbytes: int) -> torch.Tensor | None:
        """The block's payload, checked; None where it is missing or damaged (a damaged file is deleted)."""
        path = self.path(key)
        payload = torch.empty(nbytes, dtype=torch.uint8)
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER.size)
                whole = self._header_fits(header, key, nbytes) and f.readinto(payload.numpy().data) == nbytes
                whole = whole and not f.read(1)
        except OSError:
            self._forget(key)
            return None
        if not whole or xxhash.xxh3_64_intdigest(payload.numpy().data) != HEADER.unpack(header)[5]:
            log.warning("KV cache file %s is damaged or of another format: deleted", path.name)
            self.discarded += 1
            self._forget(key)
            _unlink(path)
            return None
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
        return payload

    def _header_fits(self, header: bytes, key: bytes, nbytes: int) -> bool:
        if len(header) != HEADER.size:
            return False
        magic, version, format_key, file_key, length, _ = HEADER.unpack(header)
        return (magic, version, format_key, file_key, length) == (MAGIC, VERSION, self.format_key, key, nbytes)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.nbytes -= size

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, payload: torch.Tensor) -> None:
        data = payload.numpy().data  # the tensor's own bytes, not a copy
        header = HEADER.pack(MAGIC, VERSION, self.format_key, key, len(data), xxhash.xxh3_64_intdigest(data))
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except FileNotFoundError:  # another process cleared the folder under this write: this block only is lost
            _unlink(tmp)
            self.dropped += 1
            return
        except OSError as exc:
            _unlink(tmp)
            self._fail(exc)
            return
        with self._lock:
            if key not in self.index:
                self.index[key] = HEADER.size + len(data)
                self.nbytes += HEADER.size + len(data)
            self.written += 1
            self.written_bytes += len(data)
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        """Under the lock: the least recently used files out until the folder fits its budget."""
        while self.nbytes > self.capacity and self.index:
            key, size = self.index.popitem(last=False)
            self.nbytes -= size
            self.evictions += 1
            _unlink(self.path(key))

    def _fail(self, exc: OSError) -> None:
        if self.enabled:
            log.warning("KV cache disk tier at %s turned off, RAM tier only from now: %s", self.folder, exc)
        self.enabled = False

    def flush(self, timeout_s: float) -> bool:
        """Wait until the blocks queued so far are written (or timeout_s passes); True if they all were."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        if self._writer is None:
            return
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._writer.join(timeout=1.0)


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process whose pid a temporary file's name carries (<key>.kvb.<pid>.tmp) still runs here."""
    try:
        pid = int(tmp_name.rsplit(".", 2)[-2])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # a process of another user: alive
        return True
    return pid != os.getpid()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def format_key(identity: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> bytes:
    """What a block's bytes depend on besides its tokens: the model and engine build (`identity`, the system
    fingerprint), the C kernels' build (their library's name carries a hash of their sources and flags), the KV
    dtype and shapes, and the block size."""
    k0 = kv_caches[0][0]
    lib = ops.library()
    kernels = Path(lib._name).name if lib is not None else "no kernels"
    text = f"{identity}|{kernels}|kv {k0.dtype} {len(kv_caches)}x{tuple(k0.shape[1:])}|block {block_size}"
    return hashlib.sha256(text.encode()).digest()


class KVTiers:
    """The RAM and disk tiers of one engine's prefix cache, keyed for its format (see the module's docstring)."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        ram_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        identity: str = "",
    ) -> None:
        self.copier = BlockCopier(kv_caches, block_size)
        self.format_key = format_key(identity, kv_caches, block_size)
        self.ram = RamTier(ram_bytes)
        self.disk = DiskTier(Path(disk_dir), self.format_key, disk_bytes) if disk_dir else None
        self.counts = TierStats()

    def key(self, chain_hash: bytes) -> bytes:
        return hashlib.sha256(self.format_key + chain_hash).digest()

    def has(self, chain_hash: bytes) -> bool:
        key = self.key(chain_hash)
        return key in self.ram or (self.disk is not None and key in self.disk)

    def evicted(self, chain_hashes: list[bytes], blocks: list[int]) -> None:
        """Cached blocks of the live cache about to be handed out again: their KV goes to RAM first."""
        if self.ram.capacity <= 0:
            return
        fresh = []
        for h, b in zip(chain_hashes, blocks):
            key = self.key(h)
            if self.ram.get(key) is None:
                fresh.append((key, b))
        if not fresh:
            return
        for (key, _), payload in zip(fresh, self.copier.read([b for _, b in fresh])):
            self.ram.put(key, payload)
            self.counts.ram_saved += 1
            self.counts.bytes_to_ram += payload.numel()

    def registered(self, chain_hashes: list[bytes], blocks: list[int]) -> None:
        """Blocks the live cache just registered: written to disk behind the engine (where there is a disk tier)."""
        disk = self.disk
        if disk is None or not disk.enabled or not blocks:
            return
        keyed = ((self.key(h), b) for h, b in zip(chain_hashes, blocks))
        fresh = [(key, b) for key, b in keyed if key not in disk]
        if not fresh:
            return
        for (key, _), payload in zip(fresh, self.copier.read([b for _, b in fresh])):
            disk.put(key, payload)

    def fetch(self, chain_hashes: list[bytes]) -> list[torch.Tensor]:
        """The payloads of the leading blocks a tier still holds, in order, up to the first it does not (or whose
        file is damaged); a block read from disk is kept in RAM too."""
        found: list[torch.Tensor] = []
        for h in chain_hashes:
            key = self.key(h)
            payload = self.ram.get(key)
            if payload is not None:
                self.counts.ram_hits += 1
                self.counts.bytes_from_ram += payload.numel()
            elif self.disk is not None and key in self.disk:
                payload = self.disk.get(key, self.copier.nbytes)
                if payload is None:
                    break
                self.counts.disk_hits += 1
                self.counts.bytes_from_disk += payload.numel()
                self.ram.put(key, payload)
            else:
                break
            found.append(payload)
        return found

    def place(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        """Fetched payloads copied into fresh live blocks, one each."""
        self.copier.write(blocks, payloads)

    def stats(self) -> TierStats:
        c, ram, disk = self.counts, self.ram, self.disk
        c.ram_bytes, c.ram_blocks, c.ram_capacity_bytes = ram.nbytes, len(ram.entries), ram.capacity
        c.ram_evictions = ram.evictions
        if disk is not None:
            c.disk_bytes, c.disk_blocks = disk.nbytes, len(disk.index)
            c.disk_capacity_bytes = disk.capacity if disk.enabled else 0
            c.disk_written, c.disk_write_dropped = disk.written, disk.dropped
            c.bytes_to_disk = disk.written_bytes
            c.disk_evictions, c.disk_discarded = disk.evictions, disk.discarded
        return TierStats(**vars(c))

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the disk writer to finish what was queued (bounded), then stop it."""
        if self.disk is not None:
            self.disk.close(timeout_s)
