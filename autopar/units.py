"""Numbers as people read them, shared by the core's sentences and the faces' tables."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> float | None:
    """Bytes from a size as people write it (``4GB``, ``512MiB``, ``4e9``, ``0``); None when it is not one.

    Units are decimal (KB, MB, GB, TB: powers of 1000, as `human_bytes` prints them) or binary (KiB,
    MiB, GiB, TiB), in any case; a bare number is bytes.

    >>> parse_bytes("4GB"), parse_bytes("1.5 GiB"), parse_bytes("0"), parse_bytes("4 apples")
    (4000000000.0, 1610612736.0, 0.0, None)
    """
    found = _SIZE.fullmatch(text)
    if found is None or found.group(3).lower() not in _UNITS:
        return None
    number, exponent, unit = found.groups()
    value = float(f"{number}e{exponent or 0}") * _UNITS[unit.lower()]  # float(): an overflow is inf, not an error
    return value if math.isfinite(value) else None


def human_bytes(count: float) -> str:
    """Bytes in the unit that keeps the figure short.

    >>> human_bytes(1), human_bytes(786432), human_bytes(339.67e9), human_bytes(2.1e12)
    ('1 B', '786.43 KB', '339.67 GB', '2.10 TB')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"
