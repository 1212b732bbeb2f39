"""Training with a plan: the user's own PyTorch module, sharded as planned, under torch.distributed.

``parallelize(module, plan, model, example_inputs)`` (`autopar.torch.parallel`) returns the module with DTensor
parameters, whose forward runs the plan on each rank's shards and whose ``train_step`` runs a whole step, the
plan's micro-batches and pipeline stages included, checking that the collectives it ran are the plan's.
`save`, `load` and `load_unsharded` (`autopar.torch.checkpoint`) keep sharded checkpoints that load under
another plan or into the plain module. Needs ``autopar[torch]`` (torch 2.13 and onnxscript).
"""

from autopar.torch.checkpoint import CheckpointError, load, load_unsharded, save
from autopar.torch.parallel import ParallelModule, Trainer, TrainingError, parallelize

__all__ = [
    "CheckpointError",
    "ParallelModule",
    "Trainer",
    "TrainingError",
    "load",
    "load_unsharded",
    "parallelize",
    "save",
]
