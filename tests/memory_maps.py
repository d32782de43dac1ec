"""This process's memory mappings as Linux lists them (/proc/self/smaps), for tests of how memory is held."""

from __future__ import annotations

import sys

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def mapping_field(address: int, field: str) -> list[str]:
    """The words after `field:` in the entry of the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` ("hg": advised for huge pages)."""
    return mapping_field(address, "VmFlags")


def rss_kib(address: int) -> int:
    """The resident KiB of the mapping that holds `address`."""
    return int(mapping_field(address, "Rss")[0])
