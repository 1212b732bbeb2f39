"""Progress of long work, reported by the core and shown by whoever listens (the CLI).

The core never prints: it calls `report(phase, done, total)` at natural points (a chunk of
redistribution costs, an elimination replayed), which costs nothing when nobody listens. A
face installs a listener for the duration of a call with `listening`.

>>> seen = []
>>> with listening(lambda phase, done, total: seen.append((phase, done, total))):
...     report("costing", 1, 4)
>>> seen
[('costing', 1, 4)]
>>> report("costing", 2, 4)   # nobody listens: nothing happens

Each phase counts a named unit (`unit_of`), which the progress line shows beside the counts:

>>> unit_of("costing redistributions"), unit_of("search")
('layout pairs', 'elimination steps')
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

Listener = Callable[[str, int, int], None]

PHASES = ("import", "costing", "search", "lowering")

UNITS = {  # what each phase's done/total count
    "import": "models",
    "costing operators": "operators",
    "costing redistributions": "layout pairs",
    "search": "elimination steps",
    "pipeline shapes": "shapes (stages x micro-batches)",
    "lowering": "plans",
    "comparisons": "plans",
    "sweep": "device counts",
    "verify forward": "operators",
    "verify backward": "operators",
}


def unit_of(phase: str) -> str:
    """The unit a phase counts ("steps" for a phase nobody named one for)."""
    return UNITS.get(phase, "steps")


_listener: contextvars.ContextVar[Listener | None] = contextvars.ContextVar("autopar_progress", default=None)


def report(phase: str, done: int, total: int) -> None:
    """Say that ``done`` of ``total`` units of ``phase`` are finished."""
    listener = _listener.get()
    if listener is not None:
        listener(phase, done, total)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send progress reports to ``listener`` inside the ``with`` block."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
