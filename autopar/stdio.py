"""Keeping stdout for what autopar means to write there.

Compiled libraries (HiGHS prints a banner when a solver is made) write to file descriptor 1
directly, past ``sys.stdout``. `stdout_elsewhere` points descriptor 1, and ``sys.stdout``, at
another place for a block: the ILP discards what HiGHS prints; the command line sends anything a
library prints to stderr, so that stdout carries the plan (or the table, or the JSON) alone.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_elsewhere(to_stderr: bool = False) -> Iterator[None]:
    """For the block, what anything writes to stdout (descriptor 1 and ``sys.stdout``) goes to stderr
    (``to_stderr``) or nowhere. Python's buffered output is flushed on each side of the switch, so
    nothing written before the block lands elsewhere. Without a descriptor 1 the block runs as is."""
    _flush(sys.stdout)
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 to protect
        yield
        return
    python_stdout = sys.stdout
    with contextlib.ExitStack() as stack:
        if to_stderr:
            sink, stream = 2, sys.stderr
        else:
            stream = stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
            sink = stream.fileno()
        try:
            os.dup2(sink, 1)
            sys.stdout = stream
            yield
        finally:
            _flush(stream)
            sys.stdout = python_stdout
            os.dup2(saved, 1)
            os.close(saved)


def _flush(stream: object) -> None:
    flush = getattr(stream, "flush", None)
    if flush is not None:
        with contextlib.suppress(OSError, ValueError):
            flush()
