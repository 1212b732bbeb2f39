"""Compiled kernels for the loops a large search spends its time in, where numba is installed.

A 1,024-device GPT costs about fifteen million layout pairs and runs elimination steps of three
hundred million entries; numpy does each in passes over memory (a pair's planner a round of array
operations at a time, a step's sum written out and read back to take its minimum). These kernels
do the same arithmetic in one compiled pass, in the same order, so every number is the same to the
last bit (`tests/test_native.py` checks each against the numpy path):

- ``min_plus_rows``: C[i, j] = min_k a[i, k] + b[k, j], an elimination step of two tables (`dp._sum_min`);
- ``min_plus_rows_summed``: the same over the sums an elimination step merges its parts into (a second
  table on one side, the node's own costs), made as it goes, without those sums made (`dp._min_plus_added`);
- ``min_plus_argmin``: the same with the first k at the minimum (`fold.min_plus`, a folded run's powers);
- ``pair_coefficients``: `redistribute.symbolic_steps` and its fusing, priced, for many layout pairs
  (`coefficients.pair_coefficients`);
- ``edge_tables``: a use's edge tables from its layout pairs' slots, forward and with the gradient's way
  back (`costing._edge_costs`), where numpy gathers each coefficient into a table of its own first.

They live in `autopar.search.native_jit`, which imports numba; this module does not, so the core
imports without it.

numba is optional (``pip install autopar[fast]``): without it, or with ``AUTOPAR_NATIVE=0`` in the
environment, `enabled` is False and callers keep their numpy path. Callers use the kernels only for
work large enough to repay importing numba (a second or so): a million pairs, steps and problems' edge
tables of sixteen million entries, so planning a small model never imports it. Once some work has paid
for the import, smaller work goes to the kernels too (from `LOADED` items): a large model's later
problems and smaller steps are each a few times faster compiled. Each kernel compiles on its first call
and is cached on disk, so only the first large plan on a machine pays the compilation (about six
seconds).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

PAIRS = 1 << 20
"""Layout pairs costed at once from which the compiled planner is used: numpy costs a million in about three
seconds here, where importing numba and loading the kernels takes one or two."""

ENTRIES = 1 << 24
"""Table entries (an elimination step's, a min-plus product's, a problem's edge tables') from which a kernel
is used."""


LOADED = 1 << 16
"""Items (pairs or entries) from which work goes to a kernel once numba is imported: below this, calling a
kernel and splitting its rows between threads costs about what numpy takes."""


def worth(count: int, least: int) -> bool:
    """Whether work of ``count`` items (pairs or entries) goes to a kernel: they are enabled and the work is
    at least ``least`` (`PAIRS`, `ENTRIES`), large enough to repay importing numba, or at least `LOADED`
    where the kernels are imported already."""
    if not enabled():
        return False
    return count >= least or (count >= LOADED and _KERNELS in sys.modules)


_KERNELS = "autopar.search.native_jit"


def enabled() -> bool:
    """Whether the compiled kernels are used: numba is installed and ``AUTOPAR_NATIVE`` is not ``0``."""
    return os.environ.get("AUTOPAR_NATIVE", "1") != "0" and _numba_installed()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def kernels() -> ModuleType:
    """`autopar.search.native_jit`, imported on first use."""
    from autopar.search import native_jit  # optional: numba is imported only where the kernels are used

    return native_jit
