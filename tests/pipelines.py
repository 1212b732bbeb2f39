"""Random pipelined plans of a model, for the runtime's tests and `bench/runtime.py`."""

from __future__ import annotations

import random
from collections.abc import Iterator

import onnx

import autopar
from autopar.api.planning import model_graph
from autopar.lowering import Plan


def random_pipelined_plans(model: onnx.ModelProto, seed: int = 0) -> Iterator[tuple[int, int, list[str], Plan]]:
    """(stages, micro-batches, stage starts, plan) drawn without end on 8 devices: random cuts, 2 or 4
    stages, 1 to 8 micro-batches and random strategies; a draw whose strategies the whole batch cannot
    take (semi-auto checks them there too) is drawn again."""
    names = [op.name for op in model_graph(model, None, None).ops]
    rng = random.Random(seed)
    while True:
        stages, micro_batches = rng.choice([2, 4]), rng.choice([1, 2, 4, 8])
        starts = [names[c] for c in sorted(rng.sample(range(1, len(names)), stages - 1))]
        candidates = autopar.candidates(model, devices=8 // stages, batch=8 // micro_batches)
        fixed = {op: rng.choice(options) for op, options in candidates.items()}
        try:
            plan = autopar.plan(
                model, devices=8, pipeline_stages=stages, micro_batches=micro_batches, stage_starts=starts, fixed=fixed
            )
        except autopar.AutoparError:
            continue
        yield stages, micro_batches, starts, plan
