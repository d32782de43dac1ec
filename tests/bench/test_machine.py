"""What a bench run records of its machine, its tokenmill and its peers' binaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench import machine

ZEN4 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: (a second core, never read)
"""
SAPPHIRE_RAPIDS = """\
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


@pytest.mark.parametrize(
    ("cpuinfo", "cores", "cpu", "microarch", "isa", "kind"),
    [
        (ZEN4, 2, "AMD EPYC", "zen4", ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"], "amd-epyc-zen4-avx512-2c"),
        (
            SAPPHIRE_RAPIDS,
            4,
            "Intel(R) Xeon(R) Platinum 8488C",
            "sapphirerapids",
            ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx"],
            "intel-xeon-platinum-8488c-sapphirerapids-amx-4c",
        ),
    ],
)
def test_the_machine_is_described_from_its_first_processor(
    cpuinfo: str, cores: int, cpu: str, microarch: str, isa: list[str], kind: str
) -> None:
    described = machine.describe_machine(cores, cpuinfo)
    assert described["cpu"] == cpu and described["microarch"] == microarch and described["cores"] == cores
    assert described["isa"] == isa and described["kind"] == kind


def test_a_machine_without_cpuinfo_is_named_by_its_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    described = machine.describe_machine(8, "")
    assert described["cpu"] == "aarch64" and described["vendor"] is None and described["microarch"] is None
    assert described["isa"] == [] and described["kind"] == "aarch64-8c"


def test_the_microarchitecture_comes_from_family_and_model() -> None:
    assert machine.microarch("AuthenticAMD", 0x19, 0x01) == "zen3"  # Milan
    assert machine.microarch("AuthenticAMD", 0x19, 0xA0) == "zen4"  # Bergamo
    assert machine.microarch("AuthenticAMD", 0x17, 0x31) == "zen2"  # Rome
    assert machine.microarch("GenuineIntel", 6, 0x6A) == "icelake-sp"
    assert machine.microarch("GenuineIntel", 6, 0x01) is None and machine.microarch(None, 6, 1) is None


def test_a_binary_says_its_version_on_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 4000 (abc1234)' >&2\necho 'built with cc 13 for x86_64'\necho more\n")
    binary.chmod(0o755)
    assert machine.binary_version(str(binary)) == "version: 4000 (abc1234); built with cc 13 for x86_64"
    assert machine.binary_version(str(tmp_path / "missing")) is None


def test_tokenmill_names_its_version() -> None:
    build = machine.tokenmill_build()
    assert build["version"] and (build["commit"] is None or len(build["commit"]) == 40)
