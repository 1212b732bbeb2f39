"""The `autopar` command line: plan, verify, sweep, report, inspect, export, schema, profiles.

It reads the core; the core never prints. One job a module:

- `autopar.cli.flags`: the parser, every command's flags, each checked into one sentence (exit 2);
- `autopar.cli.commands`: one function a command, from its flags to what it prints or writes;
- `autopar.cli.output`: a file replaced whole, the progress line, warnings said in one line;
- here: `main`, which runs a command and turns a user's error into one sentence and an exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from autopar.cli.commands import COMMANDS
from autopar.cli.flags import UsageError, build_parser
from autopar.errors import (
    AutoparError,
    ComputedDimensionError,
    FixedStrategyError,
    MemoryReserveError,
    PrecisionError,
    UnknownDimensionError,
    UnknownProfileError,
    UnknownSymbolError,
)

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and give its exit status.

    0: done; 1: the input is wrong or the plan does not verify; 2: a flag or a fixed strategy is wrong;
    3: a bug in autopar (``AUTOPAR_DEBUG=1`` shows the traceback); 130: interrupted.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (FixedStrategyError, UsageError) as exc:  # the user's own strategy, or flags that do not go together
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except (MemoryReserveError, PrecisionError, UnknownProfileError) as exc:  # flags checked as a profile loads
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except AutoparError as exc:
        print(f"autopar: error: {_in_flag_words(exc, dict(getattr(args, 'dim', None) or []))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug in autopar, not in the input: say so plainly
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(
            f"autopar: internal error: {type(exc).__name__}: {exc} (set AUTOPAR_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 3


_BATCH_NAMES = ("batch", "n", "b", "bs")


def _in_flag_words(exc: AutoparError, dims: dict[str, int]) -> str:
    """The core's sentence, with the flags a command-line user types instead of Python arguments."""
    if isinstance(exc, ComputedDimensionError):
        return (
            f"Tensor {exc.tensor!r} (written by {exc.op_type} {exc.operator!r}) has a size on axis {exc.axis} that is"
            f" computed from data at run time; bind it with --dim {exc.dimension}=VALUE."
        )
    if isinstance(exc, UnknownDimensionError) and exc.dimension is not None:
        return (
            f"Tensor {exc.tensor!r} has an unknown dimension {exc.dimension!r}; bind it with"
            f" --dim {exc.dimension}=VALUE (or --batch for the leading dimension)."
        )
    if isinstance(exc, UnknownDimensionError):
        return f"Tensor {exc.tensor!r} has an unknown shape; bind its dimensions with --batch or --dim."
    if isinstance(exc, UnknownSymbolError):
        have = f" (they have: {', '.join(exc.known)})" if exc.known else ""
        batch = next((name for name in exc.unknown if "batch" in name.lower() or name.lower() in _BATCH_NAMES), None)
        if batch is not None:  # the leading dimension has its own flag, symbolic or not
            value = dims.get(batch, "B")
            return (
                f"--dim names {', '.join(exc.unknown)} but the model's inputs have no such symbolic dimension{have};"
                f" set the batch, the inputs' leading dimension, with --batch {value}."
            )
        return f"--dim names {', '.join(exc.unknown)} but the model's inputs have no such symbolic dimension{have}."
    return str(exc)
