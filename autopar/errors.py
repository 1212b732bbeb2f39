"""Errors a user can cause, as values: each carries the facts; the faces word them.

The message of every `AutoparError` is a complete sentence for a Python caller. The command
line rewords the few that name something the user typed as a flag (an unbound dimension is
``--dim N=VALUE`` there, ``dims={"N": value}`` in Python).
"""

from __future__ import annotations

from pydantic import ValidationError


def first_problem(exc: ValidationError) -> str:
    """The first thing pydantic found wrong, as ``where: what`` (``ops.0.strategy: field required``)."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the top level"
    message = str(error["msg"]).removeprefix("Value error, ").rstrip(".")
    return f"{where}: {message[:1].lower()}{message[1:]}"


class AutoparError(Exception):
    """Base class: the message is a complete sentence meant for the user."""


class ModelImportError(AutoparError):
    """The model file is missing, truncated, foreign, or its shapes cannot be resolved."""


class UnknownDimensionError(ModelImportError):
    """A tensor's shape, or one dimension of it, is still unknown after binding and inference.

    ``dimension`` is the symbolic name (``"?"`` when the file gives none), or None when the
    whole shape is unknown; ``axis`` is its position.
    """

    def __init__(self, tensor: str, dimension: str | None = None, axis: int | None = None) -> None:
        self.tensor, self.dimension, self.axis = tensor, dimension, axis
        if dimension is None:
            text = f"Tensor {tensor!r} has an unknown shape; bind the model's symbolic input dimensions."
        else:
            text = (
                f"Tensor {tensor!r} has an unknown dimension {dimension!r} (axis {axis}); bind it with"
                f" dims={{{dimension!r}: value}} (or batch= for the leading dimension)."
            )
        super().__init__(text)


class ComputedDimensionError(UnknownDimensionError):
    """A size the graph computes at run time from data (``NonZero``, a ``TopK`` whose ``k`` is an input),
    which no folding of static shapes can know: named by the key ``"TENSOR:AXIS"`` the user binds.

    ``dimension`` is that key; ``op_type`` and ``operator`` name what writes the tensor.
    """

    def __init__(self, tensor: str, axis: int, op_type: str, operator: str) -> None:
        self.op_type, self.operator = op_type, operator
        key = f"{tensor}:{axis}"
        Exception.__init__(
            self,
            f"Tensor {tensor!r} (written by {op_type} {operator!r}) has a size on axis {axis} that is computed"
            f" from data at run time; bind it with dims={{{key!r}: value}}.",
        )
        self.tensor, self.dimension, self.axis = tensor, key, axis


class UnknownSymbolError(ModelImportError):
    """A dimension binding names a symbol that no input of the model has."""

    def __init__(self, unknown: list[str], known: list[str]) -> None:
        self.unknown, self.known = unknown, known
        have = f" (they have: {', '.join(known)})." if known else "."
        super().__init__(
            f"The dimension bindings name {', '.join(unknown)}, but the model's inputs have no such"
            f" symbolic dimension{have}"
        )


class StrategyError(AutoparError):
    """A user-supplied strategy is not valid for the operator it names."""


class FixedStrategyError(StrategyError):
    """A strategy the user fixed (semi-auto mode) is invalid for its operator: a flag's fault (exit 2)."""


class PlanFileError(AutoparError):
    """A plan file is unreadable, malformed, or made for another model or device count."""


class CostModelError(AutoparError):
    """A hardware profile is missing or malformed."""


class UnknownProfileError(CostModelError):
    """A cost model named by a name no bundled profile has, and not a file's path (a flag's value: exit 2)."""


class MemoryReserveError(CostModelError):
    """A memory reserve that is not a number of bytes below the device's memory (a flag's value: exit 2)."""


class PrecisionError(CostModelError):
    """A precision the profile cannot run, FP8 without FP8 units (a flag's value: exit 2)."""


class RankTableError(AutoparError):
    """A cluster description (MindSpore's rank_table.json) is unreadable, malformed, or unusable."""


class TooLargeError(AutoparError):
    """The request would exceed a stated limit (`autopar.limits`): refused before it is built."""


class SearchTooLargeError(TooLargeError):
    """The exact search would sum a table beyond `autopar.limits`; the message ends without advice, which
    the caller adds once it has tried fewer devices (they need not help: fewer can mean more layouts)."""


class InfeasibleError(AutoparError):
    """No plan fits in device memory."""


class AutoparWarning(UserWarning):
    """Base class: the plan is valid, but something about the input deserves a word."""


class FallbackWarning(AutoparWarning):
    """Some operators have no strategy rule: they run replicated, their inputs gathered."""


class RenamedOperatorsWarning(AutoparWarning):
    """Operators share a name in the file (ONNX requires unique names); the plan names them apart."""
