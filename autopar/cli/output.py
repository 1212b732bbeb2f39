"""What the command line writes besides its tables: a file replaced whole, the progress line, warnings in one line."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autopar import progress
from autopar.errors import AutoparError, AutoparWarning, FallbackWarning


def emit(text: str, out: str | None) -> None:
    """Write to ``out``, or to stdout.

    A regular file (or a new one) is replaced atomically: a temporary file beside it, then a
    rename, so an interrupted run never leaves half a plan. Anything else (a symlink, a FIFO,
    /dev/stdout) is written through, as an ordinary write would.
    """
    if not out:
        write_stdout(text)
        return
    target = Path(out)
    try:
        if target.is_symlink() or (target.exists() and not target.is_file()):
            with target.open("w", encoding="utf-8") as handle:
                handle.write(text)
            return
        _replace_atomically(target, text)
    except OSError as exc:
        raise AutoparError(f"Cannot write {out!r}: {exc.strerror or exc}.") from None


def write_stdout(text: str) -> None:
    """Write to stdout and flush, a failed write (a full disk) said in one sentence: unflushed, it failed at exit,
    after the command had said it was done. A reader that stopped reading (``| head``) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise AutoparError(f"Cannot write to standard output: {exc.strerror or exc}.") from None


def _replace_atomically(target: Path, text: str) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    try:
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, before the rename)
            "w", encoding="utf-8", dir=folder, prefix=f".{target.name}.", suffix=".tmp", delete=False
        )
    except PermissionError:  # a writable file in a folder we may not add to: write it in place
        target.write_text(text, encoding="utf-8")
        return
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(text)
        if target.exists():
            shutil.copymode(target, temporary)  # keep the file's own permissions
        else:
            umask = os.umask(0)
            os.umask(umask)
            temporary.chmod(0o666 & ~umask)  # as an ordinary write would leave it, not tempfile's 0600
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


class ProgressLine:
    """One progress line on stderr (tqdm), shown once a run has taken about two seconds: the phase, its
    counts and their unit ("autopar: search ... 40/120 elimination steps").

    Quiet with ``--quiet`` or when stderr is not a terminal (``AUTOPAR_PROGRESS=1`` shows it there too,
    for a log); the line is erased at the end.
    """

    DELAY_S = 2.0

    @classmethod
    def for_command(cls, quiet: bool) -> "ProgressLine":
        """The line a command shows: none with ``--quiet``; else on a terminal, or anywhere with AUTOPAR_PROGRESS=1."""
        forced = os.environ.get("AUTOPAR_PROGRESS", "") not in ("", "0")
        return cls(enabled=not quiet and (forced or sys.stderr.isatty()))

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = time.monotonic()
        self.phase: str | None = None
        self.bar: Any = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase != self.phase or self.bar is None or done < self.bar.n:
            self.close()
            from tqdm import tqdm

            delay = max(0.0, self.DELAY_S - (time.monotonic() - self.started))
            self.bar = tqdm(
                total=total,
                desc=f"autopar: {phase}",
                delay=delay,
                leave=False,
                file=sys.stderr,
                unit=progress.unit_of(phase),
                ncols=100,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]",
            )
            self.phase = phase
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def say_warnings(caught: Iterable[warnings.WarningMessage], plan_says: bool = False) -> None:
    """autopar's warnings, one line each on stderr, in the command line's words (``plan_says``: the plan's
    own warnings are said from it, `say_plan_warnings`, so a fallback operator is not named twice)."""
    for warning in caught:
        if plan_says and issubclass(warning.category, FallbackWarning):
            continue
        if issubclass(warning.category, AutoparWarning):
            print(f"autopar: warning: {warning.message}", file=sys.stderr)


def say_plan_warnings(sentences: Iterable[str], where: str = "") -> None:
    """The plan's warnings (`autopar.lowering.advice`, the report's list), one line each on stderr."""
    for sentence in sentences:
        print(f"autopar: warning: {where}{sentence}", file=sys.stderr)
