"""SPMD verification on virtual devices: every rank holds only its shards; collectives move data.

`runner.verify_problem` is the entry point; `devices` is the executable meaning of layouts
and collectives, `kernels` runs one operator on local shards, `values` draws test values,
`reference` runs the single-device model, `compare` judges the difference.
"""

from autopar.spmd.compare import VerifyReport
from autopar.spmd.devices import assemble, run_step, shard
from autopar.spmd.runner import resolve_plan, verify_problem
from autopar.spmd.values import materialise

__all__ = ["VerifyReport", "assemble", "materialise", "resolve_plan", "run_step", "shard", "verify_problem"]
