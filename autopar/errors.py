"""Errors a user can cause. The CLI turns each into one sentence and a non-zero exit."""


class AutoparError(Exception):
    """Base class: the message is a complete sentence meant for the user."""


class ModelImportError(AutoparError):
    """The model file is missing, truncated, foreign, or its shapes cannot be resolved."""


class StrategyError(AutoparError):
    """A user-supplied strategy is not valid for the operator it names."""


class CostModelError(AutoparError):
    """A hardware profile is missing or malformed."""


class InfeasibleError(AutoparError):
    """No plan fits in device memory."""


class FallbackWarning(UserWarning):
    """Some operators have no strategy rule: they run replicated, their inputs gathered."""
