"""SPMD verification on virtual devices: every rank holds only its shards; collectives move data.

`runner.verify_program` is the entry point: it runs the `PlanProgram` lowering gives (never the
search); `devices` is the executable meaning of layouts and collectives, `kernels` runs one
operator on local shards, `values` draws test values, `reference` runs the single-device model,
`compare` judges the difference.
"""

from autopar.spmd.compare import VerifyReport
from autopar.spmd.devices import assemble, run_step, shard
from autopar.spmd.runner import verify_program
from autopar.spmd.values import materialise

__all__ = ["VerifyReport", "assemble", "materialise", "run_step", "shard", "verify_program"]
