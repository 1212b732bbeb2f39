"""The training step of a plan in torch: on virtual ranks in one process, or on torch.distributed.

`verify.verify_training` is the entry point (``autopar verify --gradients`` / ``--runtime torch``): it
runs the `PlanProgram` lowering gives (the plan's strategies and collectives, never the search);
`program` is the SPMD step (forward, backward, gradient synchronisation), `collectives` carries
out a plan's steps on virtual ranks or with torch.distributed, `local` runs one operator on a
rank's shards, `single` the whole model on one device, `launch` the N processes. A pipelined plan
runs through `pipeline` (each stage's ranks over the micro-batches in 1F1B, point-to-point messages
between stages) and is judged by `staged_verify` against one device running the whole batch. Needs torch
(``pip install 'autopar[torch]'``); nothing else in autopar imports this package at import time.
"""
