"""Operators with no strategy rule (they run replicated, inputs gathered) whose facts still matter.

The importer must never fold a random operator, must not train Resize's scales, and the search
must not send gradients through ArgMax; the registry says so here, one line each.
"""

from __future__ import annotations

from autopar.ops.registry import Keeps, declare

declare("Shape", "Size", "ArgMax", "ArgMin", "NonZero", differentiable=False, keeps=Keeps.NOTHING)
declare("Resize", config_inputs=frozenset({1, 2, 3}))  # roi, scales, sizes
declare("Upsample", config_inputs=frozenset({1}))  # scales
declare(
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    differentiable=False,
    keeps=Keeps.NOTHING,
    foldable=False,
)
