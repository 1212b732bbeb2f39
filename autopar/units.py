"""Numbers as people read them, shared by the core's sentences and the faces' tables."""

from __future__ import annotations


def human_bytes(count: float) -> str:
    """Bytes in the unit that keeps the figure short.

    >>> human_bytes(1), human_bytes(786432), human_bytes(339.67e9), human_bytes(2.1e12)
    ('1 B', '786.43 KB', '339.67 GB', '2.10 TB')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"
