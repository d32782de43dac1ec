"""A CPU competitor for in-process measurements: a second process that spins for a while, sleeps, and spins again, as
a server's event loop or a client on the same cores takes a core now and then (scripts/engine_speed.py and
scripts/kernel_speed.py, `--busy ON_MS OFF_MS`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# spin ON ms, sleep OFF ms; bounded in time (the context manager kills it sooner)
_LOOP = """import sys, time
on, off, end = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < on:
        pass
    time.sleep(off)
"""


@contextmanager
def busy_process(on_ms: float, off_ms: float, limit_s: float = 3600.0) -> Iterator[None]:
    """While the block runs, a process busy `on_ms` in every `on_ms + off_ms` (for at most `limit_s`)."""
    process = subprocess.Popen([sys.executable, "-c", _LOOP, str(on_ms), str(off_ms), str(limit_s)])
    try:
        yield
    finally:
        process.kill()
        process.wait()
