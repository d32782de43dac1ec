"""kernels.h is the one statement of what C and Python share: its prototypes are build.SIGNATURES (what ctypes passes),
its limits are what ops.py and linear.py check, and the C sources define exactly what it declares."""

from __future__ import annotations

import ctypes
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.kernels import build, ops
from tokenmill.model import linear

Signatures = dict[str, tuple[build.CType | None, list[build.CType]]]
C_TYPES: dict[str, build.CType] = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int}
RETURNS: dict[str, build.CType | None] = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64}


def _argument(declaration: str) -> build.CType:
    """One parameter, `const uint16_t *x` or `int64_t rows`, as ctypes passes it: every pointer is a c_void_p."""
    if "*" in declaration:
        return ctypes.c_void_p
    *type_words, _name = declaration.replace("const ", "").split()
    return C_TYPES[" ".join(type_words)]


def _prototypes(header: str) -> Signatures:
    """Every `int|int64_t|void name(args);` in a C header, comments dropped, as (return type, argument types)."""
    code = re.sub(r"/\*.*?\*/", "", header, flags=re.DOTALL)
    found: Signatures = {}
    for returns, name, arguments in re.findall(r"\b(int64_t|int|void)\s+(\w+)\s*\(([^)]*)\)\s*;", code):
        declarations = [] if arguments.strip() == "void" else [a.strip() for a in arguments.split(",")]
        found[name] = (RETURNS[returns], [_argument(d) for d in declarations])
    return found


def _mismatches(declared: Signatures, table: Signatures) -> list[str]:
    """What differs between the header's prototypes and a ctypes table, one line per function."""
    problems = [f"{name}: in the table, not declared in kernels.h" for name in table.keys() - declared.keys()]
    problems += [f"{name}: declared in kernels.h, not in the table" for name in declared.keys() - table.keys()]
    for name in declared.keys() & table.keys():
        (c_returns, c_arguments), (py_returns, py_arguments) = declared[name], table[name]
        if c_returns is not py_returns:
            problems.append(f"{name}: returns {c_returns} in kernels.h, {py_returns} in the table")
        if c_arguments != py_arguments:
            problems.append(f"{name}: arguments {c_arguments} in kernels.h, {py_arguments} in the table")
    return sorted(problems)


def test_the_ctypes_table_is_the_headers_prototypes() -> None:
    declared = _prototypes(build.KERNELS_H.read_text())
    assert len(declared) == 39
    assert _mismatches(declared, build.SIGNATURES) == []


def _drop_last_argument(table: Signatures) -> None:
    returns, arguments = table["paged_attention"]
    table["paged_attention"] = (returns, arguments[:-1])


def _swap_a_type(table: Signatures) -> None:
    returns, arguments = table["rms_norm"]
    table["rms_norm"] = (returns, [*arguments[:-1], ctypes.c_int64])  # eps as an int64


def _void_return(table: Signatures) -> None:
    table["argmax_rows"] = (None, table["argmax_rows"][1])


@pytest.mark.parametrize(
    ("drift", "expected"),
    [
        (_drop_last_argument, "paged_attention: arguments"),
        (_swap_a_type, "rms_norm: arguments"),
        (_void_return, "argmax_rows: returns"),
        (lambda table: table.pop("gelu_mul"), "gelu_mul: declared in kernels.h, not in the table"),
        (lambda table: table.update(softmax=(None, [])), "softmax: in the table, not declared"),
    ],
)
def test_the_check_catches_a_table_that_drifted_from_the_header(
    drift: Callable[[Signatures], object], expected: str
) -> None:
    table = dict(build.SIGNATURES)
    drift(table)
    (problem,) = _mismatches(_prototypes(build.KERNELS_H.read_text()), table)
    assert problem.startswith(expected)


def test_the_check_reads_c_parameter_types() -> None:
    header = "/* a(int) */ int f(const uint16_t *x, int64_t n,\n float eps, int threads);\nvoid g(void);"
    assert _prototypes(header) == {
        "f": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int]),
        "g": (None, []),
    }


@pytest.mark.parametrize("flags", [["-march=native", "-fopenmp"], ["-march=x86-64"]], ids=["native-openmp", "stubs"])
def test_the_sources_define_exactly_what_the_header_declares(flags: list[str], tmp_path: Path) -> None:
    """A definition that differs from its prototype does not compile; an exported function the header does not
    declare is a missing-prototype error. Both builds: the real kernels, and the stubs without AVX or OpenMP."""
    compiler = build.Compiler.find()
    if compiler is None:
        pytest.skip("no C compiler")
    command = [compiler.command, "-fsyntax-only", "-Werror=missing-prototypes", *flags, *map(str, build.SOURCES)]
    if "-fopenmp" in flags and not compiler.has_openmp(tmp_path):
        pytest.skip("no OpenMP")
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_python_checks_the_limits_the_header_sets() -> None:
    limits = build.header_defines()
    assert (ops.MAX_HEAD_DIM, ops.MAX_ATTENTION_HEAD_DIM) == (limits["MAX_HEAD_DIM"], limits["MAX_ATTENTION_HEAD_DIM"])
    assert (linear.INT8_TILE, linear.INT8_TILED_K) == (limits["INT8_MATMUL_TILE"], limits["INT8_MATMUL_K_MULTIPLE"])
