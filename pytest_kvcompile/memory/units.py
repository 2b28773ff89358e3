"""Sizes in bytes, read and written the pytest-memray way: a number and a unit, all powers of 1024."""

from __future__ import annotations

import re

SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?)?B\s*", re.IGNORECASE)
POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``"64 MiB"`` or ``"1.5GB"`` (powers of 1024); ValueError names the format."""
    match = SIZE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"{text!r} is not a size: write a number and a unit, e.g. \"64 MiB\" "
                         f"(units B, KB, MB, GB, TB or KiB, MiB, GiB, TiB: powers of 1024)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** POWERS[(unit or "")[:1].upper()])


def format_bytes(n: float) -> str:
    """``12,345 B (12.1 KiB)``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(n):,} B" if unit == "B" else f"{int(n):,} B ({value:.1f} {unit})"
