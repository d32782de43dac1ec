"""What a bench run ran on and with: this machine's CPU, tokenmill's version and commit, a peer binary's own version.

A run's figures only mean something beside the machine that made them, so the bench's JSON carries them (meta), and
the machine's kind (`kind`: vendor, CPU model, microarchitecture, widest vector ISA, cores) names its file in
docs/bench/: a new run on the same kind of machine replaces the last one. Cloud CPUs often report a bare model name
("AMD EPYC"), so the microarchitecture comes from the CPU family and model numbers where this module knows them.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

# the ISA features the kernels of tokenmill and llama.cpp choose between, as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
# (vendor, family) → [(first model, last model, microarchitecture)]
MICROARCH: dict[tuple[str, int], list[tuple[int, int, str]]] = {
    ("AuthenticAMD", 0x17): [(0x00, 0x2F, "zen"), (0x30, 0xFF, "zen2")],
    ("AuthenticAMD", 0x19): [(0x10, 0x1F, "zen4"), (0x60, 0x7F, "zen4"), (0xA0, 0xAF, "zen4"), (0x00, 0xFF, "zen3")],
    ("AuthenticAMD", 0x1A): [(0x00, 0xFF, "zen5")],
    ("GenuineIntel", 6): [
        (0x55, 0x55, "skylake-sp"),
        (0x6A, 0x6A, "icelake-sp"),
        (0x8F, 0x8F, "sapphirerapids"),
        (0xCF, 0xCF, "emeraldrapids"),
        (0xAD, 0xAD, "graniterapids"),
    ],
}
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}
NOISE = re.compile(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|\b\d+-core\b|@.*$", re.IGNORECASE)


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def describe_machine(cores: int, cpuinfo: str | None = None) -> dict[str, Any]:
    """This machine for a run's meta; `cpuinfo`: /proc/cpuinfo's text (read here by default; empty off Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields = cpuinfo_fields(cpuinfo)
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id")
    family, model = _number(fields.get("cpu family")), _number(fields.get("model"))
    machine: dict[str, Any] = {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "vendor": vendor,
        "family": family,
        "model": model,
        "microarch": microarch(vendor, family, model),
        "arch": platform.machine(),
        "cores": cores,
        "isa": ["amx" if flag == "amx_tile" else flag for flag in ISA_FLAGS if flag in flags],
    }
    machine["kind"] = machine_kind(machine)
    return machine


def microarch(vendor: str | None, family: int | None, model: int | None) -> str | None:
    if vendor is None or family is None or model is None:
        return None
    for first, last, name in MICROARCH.get((vendor, family), []):
        if first <= model <= last:
            return name
    return None


def machine_kind(machine: dict[str, Any]) -> str:
    """A file-name slug for machines that should measure alike, e.g. `amd-epyc-zen4-avx512-2c`."""
    words = slug(NOISE.sub(" ", machine["cpu"])).split("-")
    vendor = VENDORS.get(machine["vendor"] or "")
    if vendor and words[:1] != [vendor]:
        words.insert(0, vendor)
    for word in (machine["microarch"], isa_tier(machine["isa"]) or slug(machine["arch"])):
        if word and word not in words:
            words.append(word)
    return slug("-".join([*words, f"{machine['cores']}c"]))


def isa_tier(isa: list[str]) -> str | None:
    """The widest of the vector ISAs in `isa`."""
    return next((tier for tier in ("amx", "avx512", "avx2") if any(f.startswith(tier) for f in isa)), None)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def tokenmill_build() -> dict[str, Any]:
    """tokenmill's installed version, and the git commit of its source tree where it runs from a checkout."""
    try:
        version: str | None = importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        version = None
    tree = Path(__file__).resolve().parents[2]
    commit = _git(tree, "rev-parse", "HEAD")
    status = _git(tree, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": version, "commit": commit, "dirty": None if status is None else bool(status)}


def binary_version(binary: str) -> str | None:
    """What a llama.cpp-style binary says of itself with `--version` (its build number and commit, then the compiler),
    on one line; None where it will not say."""
    try:
        probe = subprocess.run(
            [binary, "--version"], check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in probe.stdout.splitlines() if line.strip()]
    return "; ".join(lines[:2]) if probe.returncode == 0 and lines else None


def _git(tree: Path, *command: str) -> str | None:
    if not (tree / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(tree), *command], check=True, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None
