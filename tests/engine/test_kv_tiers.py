"""The prefix cache's RAM and disk tiers: blocks evicted from the live cache, or written before a restart, come back
with the same KV, the same tokens and logprobs, and damaged or foreign files are ignored and deleted."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import TOK, ByteTokenizer, run_all, tiny_core, tiny_model
from tokenmill.config import Config
from tokenmill.engine import kv_tiers
from tokenmill.engine.core import EngineCore
from tokenmill.engine.kv_cache import PrefixHashes
from tokenmill.engine.kv_tiers import HEADER, BlockCopier, DiskTier, KVTiers, RamTier
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.kernels import ops
from tokenmill.server.engine_core import build_engine_core

BLOCK = 4
PROMPT = TOK.encode("a long shared preamble that several prompts start with, and then a question")
OTHERS = [TOK.encode(f"{word} other text that pushes the first prompt's blocks out of the cache") for word in "xyz"]


def kv_caches(layers: int = 3, slots: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(slots, 2, 8), torch.randn(slots, 2, 8)) for _ in range(layers)]


def scored(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, logit_bias={TOK.eos_id: -100.0})


def answer(core: EngineCore, request_id: str, prompt: list[int] = PROMPT) -> tuple[list[int], list[float], int]:
    """A greedy completion's tokens, their logprobs, and the prompt tokens the prefix cache gave it."""
    core.add_request(request_id, prompt, scored())
    outs: list[RequestOutput] = run_all(core)[request_id]
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    logprobs = [e.logprob for o in outs for d in o.deltas for e in d.logprobs or [] if e.logprob is not None]
    return tokens, logprobs, outs[0].num_cached_tokens


def small_core(**overrides: object) -> EngineCore:
    """A live cache of 24 blocks of 4 tokens: the other prompts evict the first one's blocks."""
    return tiny_core(block_size=BLOCK, num_kv_blocks=24, **overrides)


def evict(core: EngineCore) -> None:
    for i, prompt in enumerate(OTHERS):
        answer(core, f"other-{i}", prompt)


def test_blocks_copy_out_and_back_exactly() -> None:
    caches = kv_caches()
    copier = BlockCopier(caches, block_size=4)
    before = [(k[8:16].clone(), v[8:16].clone()) for k, v in caches]
    payloads = copier.read([2, 3])
    assert [p.shape for p in payloads] == [(copier.nbytes,)] * 2
    copier.write([6, 0], payloads)
    for (k, v), (k_old, v_old) in zip(caches, before):
        assert torch.equal(k[24:28], k_old[:4]) and torch.equal(k[0:4], k_old[4:])
        assert torch.equal(v[24:28], v_old[:4]) and torch.equal(v[0:4], v_old[4:])
    with pytest.raises(ValueError, match="contiguous bytes"):
        copier.write([1], [payloads[0][:-1]])


def test_regions_copy_without_the_kernels_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "library", lambda: None)
    caches = kv_caches()
    copier = BlockCopier(caches, block_size=4)
    payloads = copier.read([5])
    copier.write([1], payloads)
    assert all(torch.equal(k[4:8], k[20:24]) and torch.equal(v[4:8], v[20:24]) for k, v in caches)


def test_the_ram_tier_drops_the_least_recently_used_past_its_budget() -> None:
    ram = RamTier(capacity=300)
    for key in (b"a", b"b", b"c"):
        ram.put(key, torch.zeros(100, dtype=torch.uint8))
    assert ram.get(b"a") is not None  # a is now the most recently used
    ram.put(b"d", torch.zeros(100, dtype=torch.uint8))
    assert list(ram.entries) == [b"c", b"a", b"d"] and ram.nbytes == 300 and ram.evictions == 1


def test_an_evicted_prefix_comes_back_from_ram_with_the_same_tokens_and_logprobs() -> None:
    core = small_core(kv_cache_ram_gb=0.01)
    first = answer(core, "first")
    evict(core)
    assert core.blocks.hash_to_block.keys().isdisjoint(core.blocks.tiers.ram.entries)  # nothing left live: RAM keys
    tokens, logprobs, cached = answer(core, "again")
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK
    assert (tokens, logprobs) == first[:2]
    stats = core.snapshot_stats()
    assert stats.kv_ram_hits == cached // BLOCK and stats.kv_ram_saved > 0 and stats.kv_bytes_from_ram > 0


def test_an_8bit_cache_s_rows_copy_as_bytes() -> None:
    """An 8-bit cache's rows (codes, then float16 scales) are bytes like any other: a block goes out and back whole."""
    torch.manual_seed(1)
    caches = [(torch.randint(-127, 128, (32, 1, 36), dtype=torch.int8),) * 2 for _ in range(2)]
    copier = BlockCopier(caches, block_size=4)  # type: ignore[arg-type]
    assert copier.nbytes == 2 * 2 * 4 * 36
    before = caches[1][0][8:12].clone()
    copier.write([5], copier.read([2]))
    assert torch.equal(caches[1][0][20:24], before)


def test_without_tiers_the_evicted_prefix_is_computed_again() -> None:
    core = small_core(kv_cache_ram_gb=0)
    assert core.blocks.tiers is None
    answer(core, "first")
    evict(core)
    assert answer(core, "again")[2] < (len(PROMPT) - 1) // BLOCK * BLOCK


def test_a_salted_prefix_is_not_found_without_its_salt() -> None:
    core = small_core(kv_cache_ram_gb=0.01)
    core.add_request("salted", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, cache_salt="tenant-a"))
    run_all(core)
    evict(core)
    assert answer(core, "plain")[2] == 0


def test_a_restart_finds_the_prefix_on_disk(tmp_path: Path) -> None:
    first_core = small_core(kv_cache_ram_gb=0, kv_cache_dir=str(tmp_path))
    first = answer(first_core, "first")
    first_core.close()
    assert list(tmp_path.glob("*/*.kvb"))
    core = small_core(kv_cache_ram_gb=0, kv_cache_dir=str(tmp_path))
    tokens, logprobs, cached = answer(core, "after-restart")
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK
    assert (tokens, logprobs) == first[:2]
    assert core.snapshot_stats().kv_disk_hits == cached // BLOCK


def test_another_model_does_not_find_the_files(tmp_path: Path) -> None:
    def core_of(identity: str) -> EngineCore:
        config = Config(
            dtype="float32", block_size=BLOCK, num_kv_blocks=24, kv_cache_ram_gb=0, kv_cache_dir=str(tmp_path)
        )
        return build_engine_core(tiny_model(), ByteTokenizer(), config, identity)  # type: ignore[arg-type]

    core = core_of("fp_model_a")
    answer(core, "first")
    core.close()
    assert answer(core_of("fp_model_b"), "other-model")[2] == 0
    assert answer(core_of("fp_model_a"), "same-model")[2] > 0


def written_files(tmp_path: Path) -> list[Path]:
    """The prompt's matchable blocks' files, in chain order."""
    core = small_core(kv_cache_ram_gb=0, kv_cache_dir=str(tmp_path))
    core.add_request("first", PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    run_all(core)
    core.close()
    tiers, hashes = core.blocks.tiers, PrefixHashes()
    assert tiers is not None and tiers.disk is not None
    return [tiers.disk.path(tiers.key(hashes.block(i, PROMPT, BLOCK))) for i in range((len(PROMPT) - 1) // BLOCK)]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another format", "another key", "empty"])
def test_a_damaged_file_is_ignored_and_deleted(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    files = written_files(tmp_path)
    assert all(p.exists() for p in files)
    bad = files[3]
    data = bytearray(bad.read_bytes())
    if damage == "flip a byte":
        data[-7] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "another format":
        data[8] ^= 1  # the header's format key
    elif damage == "another key":
        data = bytearray(files[4].read_bytes())  # a whole, valid file of another block under this block's name
    else:
        data = bytearray()
    bad.write_bytes(bytes(data))
    core = small_core(kv_cache_ram_gb=0, kv_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        tokens, _, cached = answer(core, "after-damage")
    assert cached == 3 * BLOCK  # the blocks before the damaged one
    assert core.snapshot_stats().kv_disk_discarded == 1
    core.close()
    rewritten = bad.read_bytes()  # the block computed again and written whole
    assert rewritten != bytes(data) and len(rewritten) == len(files[0].read_bytes())
    assert any("damaged" in r.message for r in caplog.records)
    fresh = small_core(kv_cache_ram_gb=0)
    assert tokens == answer(fresh, "cold")[0]


def test_the_disk_budget_is_enforced_on_start_oldest_out(tmp_path: Path) -> None:
    files = written_files(tmp_path)
    size = files[0].stat().st_size
    for path in files[0].parent.iterdir():  # the block past the prompt's matchable ones: older than all of them
        os.utime(path, ns=(500_000_000, 500_000_000))
    for i, path in enumerate(files):  # the first in the chain the oldest
        os.utime(path, ns=(1_000_000_000 * (i + 1), 1_000_000_000 * (i + 1)))
    disk = DiskTier(tmp_path, bytes.fromhex(files[0].parent.name) + bytes(24), capacity=3 * size)
    try:
        assert disk.nbytes <= 3 * size and len(disk.index) == 3
        assert [p.exists() for p in files] == [False] * (len(files) - 3) + [True] * 3
    finally:
        disk.close(5.0)


def test_a_disk_that_fails_turns_the_tier_off_once_and_requests_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_tiers.os, "replace", full)
    core = small_core(kv_cache_ram_gb=0.01, kv_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        first = answer(core, "first")
        core.blocks.tiers.disk.flush(30.0)
        evict(core)
        again = answer(core, "again")
    assert again[:2] == first[:2] and again[2] > 0  # from RAM
    assert sum("turned off" in r.message for r in caplog.records) == 1
    assert core.snapshot_stats().kv_disk_capacity_bytes == 0
    assert not list(tmp_path.glob("*/*"))  # no temporary file left behind


def test_a_folder_that_cannot_be_made_leaves_ram_only(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    core = small_core(kv_cache_ram_gb=0.01, kv_cache_dir=str(blocker))
    assert answer(core, "first")[0]
    assert core.blocks.tiers.disk is not None and not core.blocks.tiers.disk.enabled


KILLED_WRITER = """
import sys, torch
from pathlib import Path
from tokenmill.engine.kv_tiers import DiskTier
disk = DiskTier(Path(sys.argv[1]), bytes(32), capacity=1 << 40)
print("ready", flush=True)
for i in range(1_000_000):
    disk.put(i.to_bytes(32, "big"), torch.full((1 << 16,), i % 251, dtype=torch.uint8))
"""


def test_a_kill_during_writes_leaves_files_that_are_read_or_discarded_cleanly(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*/*.kvb"))) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    disk = DiskTier(tmp_path, bytes(32), capacity=1 << 40)
    try:
        assert not [p for p in tmp_path.glob("*/*") if not p.name.endswith(".kvb")]  # temporary files removed
        assert len(disk.index) >= 20
        for key in list(disk.index):
            payload = disk.get(key, 1 << 16)
            if payload is not None:  # a whole file: exactly what was written
                assert torch.equal(payload, torch.full((1 << 16,), int.from_bytes(key, "big") % 251, dtype=torch.uint8))
        assert disk.discarded <= 1  # at most the file being renamed when the process died
    finally:
        disk.close(5.0)


def test_a_start_leaves_the_temporary_files_of_a_live_writer_alone(tmp_path: Path) -> None:
    """Replicas may share a folder: one starting must not delete what another is writing, only what a dead one left."""
    folder = tmp_path / bytes(32).hex()[:16]
    folder.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = folder / f"{'ab' * 32}.kvb.{sleeper.pid}.tmp"
        dead = folder / f"{'cd' * 32}.kvb.{2**22 + 12345}.tmp"  # above Linux's largest pid: no such process
        live.write_bytes(b"half")
        dead.write_bytes(b"half")
        disk = DiskTier(tmp_path, bytes(32), capacity=1 << 30)
        disk.close(5.0)
        assert live.exists() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


def test_tiers_are_keyed_by_format() -> None:
    caches = kv_caches()
    a = KVTiers(caches, 4, ram_bytes=1 << 20, identity="model a")
    b = KVTiers(caches, 4, ram_bytes=1 << 20, identity="model b")
    assert a.key(b"chain") != b.key(b"chain") and a.key(b"chain") != a.key(b"other chain")
    assert HEADER.size < 128
