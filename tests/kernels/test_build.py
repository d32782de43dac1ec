"""Where the kernels are built and loaded from (tokenmill/kernels/build.py): only a directory of the user's own, under
a key that names the compiler and OpenMP, and one warning per cause. Nothing here compiles the kernels."""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import setuptools
import torch
import torch.nn.functional as F

from tokenmill.kernels import build, ops
from tokenmill.model.layers import RMSNorm

GCC = build.Compiler("cc", "/usr/bin/gcc-12", "cc (Debian 12.2.0-14) 12.2.0")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees no warning logged yet, and leaves ops' cached library as the other tests expect it."""
    monkeypatch.setattr(build, "_warned", set())
    monkeypatch.delenv("TOKENMILL_FUSED", raising=False)
    yield
    ops.library.cache_clear()
    ops._built.cache_clear()


def _no_compiling(*args: object, **kwargs: object) -> bool:
    raise AssertionError("nothing may be compiled into an unsafe directory")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == build.__name__]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_kernel_directory_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        directory = build.private_directory(tmp_path / "cache" / "tokenmill" / "kernels")
    finally:
        os.umask(old)
    assert directory.is_dir() and _mode(directory) == 0o700


def test_a_directory_of_ours_that_others_can_only_read_is_tightened_to_0700(tmp_path: Path) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    assert build.private_directory(directory) == directory and _mode(directory) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_to_is_refused_and_left_as_it_is(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(build.UnsafeCache, match="writable by group or others"):
        build.private_directory(directory)
    assert _mode(directory) == mode


def test_a_directory_owned_by_someone_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    someone_else = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: someone_else)
    with pytest.raises(build.UnsafeCache, match="belongs to uid"):
        build.private_directory(directory)


def test_a_symlinked_kernel_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "kernels").symlink_to(real)
    with pytest.raises(build.UnsafeCache, match="symbolic link"):
        build.private_directory(tmp_path / "kernels")


def test_a_library_that_is_a_symlink_or_writable_by_others_is_not_loaded(tmp_path: Path) -> None:
    library = tmp_path / "kernels-0123-openmp.so"
    library.write_bytes(b"")
    library.chmod(0o755)
    build.check_library_file(library)
    (tmp_path / "link.so").symlink_to(library)
    with pytest.raises(build.UnsafeCache, match="symbolic link"):
        build.check_library_file(tmp_path / "link.so")
    library.chmod(0o666)
    with pytest.raises(build.UnsafeCache, match="writable"):
        build.check_library_file(library)


def test_an_unsafe_cache_means_no_library_the_torch_path_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "kernels"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(build, "default_directory", lambda: shared)
    monkeypatch.setattr(build, "compile_kernels", _no_compiling)
    monkeypatch.setattr(build.Compiler, "find", classmethod(lambda cls: GCC))
    monkeypatch.setattr(build.Compiler, "has_openmp", _no_compiling)
    ops.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert ops.library() is None and build.library() is None
    (warning,) = _warnings(caplog)
    assert str(shared) in warning and "docs/decisions/0002-no-prebuilt-kernels.md" in warning and "0700" in warning
    assert list(shared.iterdir()) == []
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 5).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-6, offset=1.0)
    assert not ops.usable(x)
    assert torch.equal(norm(x), F.rms_norm(x.float(), (64,), norm.factor, 1e-6).to(torch.bfloat16))


def test_no_compiler_means_no_library_and_one_warning_that_says_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.library(tmp_path / "kernels") is None and build.library(tmp_path / "kernels") is None
    (warning,) = _warnings(caplog)
    assert (
        "no C compiler" in warning
        and "Install gcc" in warning
        and "docs/decisions/0002-no-prebuilt-kernels.md" in warning
    )
    with pytest.raises(build.NoCompiler):
        build.compile_kernels(tmp_path / "kernels.so")


def test_the_cache_key_names_the_compiler_version_and_openmp() -> None:
    newer = build.Compiler(GCC.command, GCC.path, "cc (Debian 12.3.0-1) 12.3.0")
    elsewhere = build.Compiler(GCC.command, "/opt/gcc/bin/gcc", GCC.version)
    key = build.cache_key(GCC, openmp=True)
    assert build.cache_key(GCC, openmp=True) == key  # stable: a later start finds the build
    assert len({key, build.cache_key(newer, True), build.cache_key(elsewhere, True), build.cache_key(GCC, False)}) == 4
    assert build.library_name(GCC, True) != build.library_name(GCC, False)
    assert build.library_name(GCC, False).endswith("-serial.so")


def test_the_cache_key_covers_every_header_the_sources_include() -> None:
    included = {
        line.split('"')[1]
        for source in build.SOURCES + build.HEADERS
        for line in source.read_text().splitlines()
        if line.startswith('#include "')
    }
    assert included <= {header.name for header in build.HEADERS}
    assert "kernels.h" in included


def test_every_kernel_file_is_compiled_and_in_the_cache_key() -> None:
    """A .c file missing from SOURCES is never compiled (its functions absent from the library); a header missing from
    HEADERS leaves the cache key blind to its changes, so a stale library would load."""
    assert set(build.HERE.glob("*.c")) == set(build.SOURCES)
    assert set(build.HERE.glob("*.h")) == set(build.HEADERS)


def test_the_kernel_sources_ship_with_the_package() -> None:
    """tokenmill.kernels must be a package for setuptools to install it, with its .c and .h files as package data."""
    root = Path(build.__file__).parents[2]
    assert "tokenmill.kernels" in setuptools.find_packages(str(root), include=["tokenmill*"])
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"*.c", "*.h"} <= set(package_data["tokenmill.kernels"])
