"""Checkpoints of a parallelized module and its optimizer: ``torch.distributed.checkpoint``, sharded.

Every rank writes its own shards (`save`), named by the module's own ``state_dict`` keys with each tensor's
global shape, so a checkpoint saved under one plan loads under another (`load`: each rank reads the regions
its new shards cover) and into the plain module in one process (`load_unsharded`, then a strict
``load_state_dict``). The optimizer's state travels with it, and a module that drops its dropout's seed and
the passes drawn so far (`autopar.torch.dropout`), so a run resumed from a checkpoint takes the steps it would
have taken without stopping (its masks too, where the plan it resumes under has as many micro-batches: the
checkpoint's seed replaces one given to `parallelize`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autopar.errors import AutoparError


class CheckpointError(AutoparError):
    """A checkpoint that cannot be read into this module."""


def save(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Write the module's (and the optimizer's) shards to the folder ``path``, every rank its own."""
    dcp.save(_state(module, optimizer), checkpoint_id=str(path))


def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Read a checkpoint into the module (and the optimizer), whatever plan it was saved under."""
    state = _state(module, optimizer)
    if "dropout" in state and not _holds(path, "dropout"):
        del state["dropout"]  # saved from a module that did not drop: it draws on from its own start
    _read(state, path, no_dist=False)
    if "dropout" in state:
        module.autopar.restore_dropout(state["dropout"])  # type: ignore[operator, union-attr]
    if optimizer is not None:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_state_dict(module, [], model_state_dict=state["model"], optim_state_dict={})


def _state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a checkpoint holds: the module's state, the optimizer's, and where the module drops, its dropout's."""
    model_state, optim_state = get_state_dict(module, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    trainer = getattr(module, "autopar", None)
    if trainer is not None and trainer.rank_program.draws:
        state["dropout"] = trainer.dropout_state()
    return state


def load_unsharded(module: torch.nn.Module, path: str | Path) -> None:
    """Read a checkpoint's weights into the plain module in this one process (no torch.distributed job)."""
    state = {"model": {key: value.detach().clone() for key, value in module.state_dict().items()}}
    _read(state, path, no_dist=True)
    module.load_state_dict(state["model"], strict=True)


def _holds(path: str | Path, key: str) -> bool:
    """Whether the checkpoint saved a value under ``key`` (True where its metadata cannot be read: `_read` says why)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:  # (a folder that is not a checkpoint: `_read`'s sentence)
        return True
    return key in metadata.state_dict_metadata


def _read(state: dict[str, Any], path: str | Path, no_dist: bool) -> None:
    if not Path(path).is_dir():
        raise CheckpointError(f"Checkpoint {str(path)!r} is not a folder a checkpoint was saved in.")
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    except Exception as exc:  # DCP wraps every rank's failure; the first line says what
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"Checkpoint {str(path)!r} cannot be read into this module: {first}") from None
