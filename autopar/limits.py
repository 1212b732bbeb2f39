"""The limits autopar states instead of hitting: beyond them a request is refused in one sentence.

Each bound keeps a run inside this machine class (2 cores, 24 GB) and inside what the model of
a training step means; each refusal names the bound. Raise them here, with a reason, if the
code they guard gets faster.
"""

from __future__ import annotations

import os

MAX_DEVICES = 1 << 16
"""65,536 devices (16 mesh bits): beyond any cluster a single job trains on today."""

MAX_DIMENSION = 1 << 24
"""16,777,216 for a batch or a bound dimension. ONNX's shape inference with data propagation
holds one entry per element of a 1-D integer input (a label vector), so a batch of 2^31 would
need tens of GB before planning starts; 2^24 costs about 1.4 GB and 4 s."""

MAX_SEED = (1 << 64) - 1
"""Any non-negative integer below 2^64 seeds numpy's generator; a negative seed has no meaning."""

MAX_MICRO_BATCHES = 64
"""Micro-batches a plan may run the batch as (each count dividing the batch, up to this, is searched where
memory binds): 1F1B's bubble can then be as small as (S - 1) / (S + 63) of a step. The Megatron-LM runs
`bench/megatron.py` reproduces use up to 56 (Narayanan et al., SC21, Table 1)."""

MAX_CANDIDATES_PER_OPERATOR = 50_000
"""Strategies of one operator (label splits with product <= devices): the costing loops over them."""

MAX_EDGE_CELLS = 200_000_000
"""Producer x consumer candidate pairs summed over the dataflow: 1.6 GB of float64 cost tables."""

MAX_LAYOUT_PAIRS = 20_000_000
"""Distinct (producer layout, consumer layout) redistributions costed, about 3 us each with numpy
here (`bench/scale.py`; 0.2 us compiled, `search.native`): a minute of costing and about 2 GB of working
arrays at the limit.
ResNet-50 needs 0.81 million at 1,024 devices, one GPT-3-shaped layer 8.8 million."""

YOUNG_COLLECTION = 50_000
"""Allocations between two collections of the youngest generation while a plan is under way, in the search
and its helper (Python's default: 700; `api.planning._Collector`)."""

MAX_TABLE_ENTRIES = 400_000_000
"""Entries one elimination step sums and minimises (its operators' layouts multiplied): summed a slab
at a time, never held whole, about a second each. GPT-3's attention at 1,024 devices needs 140 million."""

MAX_TABLE_LEFT = 50_000_000
"""Entries of the table one elimination step leaves behind, which is kept (400 MB of float64)."""

MAX_VERIFY_BYTES = 20_000_000_000
"""Weights and inputs (held whole and as shards, so counted three times) plus every activation of
a verification run: DenseNet-121 at batch 32 needs 10.4 GB; ResNet-50 at batch 256 would need 39 GB."""

WORKERS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Threads for the two numpy-heavy loops (costing chunks, large DP steps) at most: numpy releases the GIL.
The cores this process may run on (``taskset -c 0`` leaves one: two threads there only take turns)."""
