"""The user's module as the dynamo ONNX exporter saw it: `torch.export`, then the exporter's decompositions.

``torch.onnx.export(module, args, dynamo=True)`` captures the module with ``torch.export.export(...,
strict=False)``, decomposes what the ONNX registry has no translation for, and names every ONNX value
and operator after the FX node it came from (``pkg.torch.onnx.fx_node`` in each operator's metadata).
`exported_program` takes the same two steps, so its nodes carry the names the plan's model file spells.
The decomposition table is the exporter's own (torch 2.13's ``torch.onnx._internal.exporter``, which the
``torch`` extra pins); `onnxscript` provides its registry, as it does for the export itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from autopar.errors import AutoparError


class CaptureError(AutoparError):
    """The module cannot be captured as the dynamo exporter captures it."""


def exported_program(module: torch.nn.Module, inputs: Sequence[Any]) -> torch.export.ExportedProgram:
    """``module`` called on ``inputs``, captured and decomposed as ``torch.onnx.export(dynamo=True)`` does."""
    try:
        from torch.onnx._internal.exporter import _core, _registration
    except ImportError as exc:  # onnxscript missing, or another torch
        raise CaptureError(
            f"Training with a plan needs the dynamo ONNX exporter's decompositions ({exc}): pip install"
            " 'autopar[torch]' (torch==2.13.0 and onnxscript)."
        ) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations, not the user's
            program = torch.export.export(module, tuple(inputs), strict=False)
    except Exception as exc:  # torch.export raises many kinds; the user needs the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"torch.export cannot capture the module on these inputs: {first}") from None
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" is not news to a language model
    try:
        registry = _registration.ONNXRegistry.from_torchlib()
    finally:
        quiet.setLevel(level)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _core._prepare_exported_program_for_export(program, registry=registry)
