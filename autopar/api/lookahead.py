"""Pipeline shapes' floors, worked out ahead in a helper process while the search runs.

Where memory binds a large model, the search rules most pipeline shapes out by their floors
(`autopar.search.pipeline.pipeline_floor`) before it searches a stage, yet each floor needs the
model imported at the shape's micro-batch and its problem costed: seconds a shape, and most of a
1,024-device plan's time (76.1B GPT: 11 of 15 pipeline shapes). A helper process, on a core the
search leaves idle, works the floors out in the order the search visits the shapes, and the search
skips a shape whose floor cannot beat its best plan without building it.

The plan is the same with the helper or without it, whenever its answers arrive: a floor is the
number the search computes itself before it searches a stage, a shape is skipped only where its floor
is clearly no faster than the best plan (a margin far above rounding, so a floor computed in another
process in another order of sums decides nothing the search's own would not), and a shape whose
floor is not in yet is built and searched as before. The helper starts only for large models with
shapes to rule out, on a machine with more than one core, and ``AUTOPAR_LOOKAHEAD=0`` turns it off.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx

from autopar.cost import CostModel
from autopar.graph import Graph
from autopar.search.pipeline import PipelineShape

MARGIN = 1e-9
"""How much slower than the best plan (relative) a floor must be for the search to skip its shape: sums
in another order differ in their last bits, far below this."""


@dataclass(frozen=True)
class Job:
    """What the helper needs to cost a shape's problem as the search would (`_Shapes.problem`)."""

    model: str | bytes  # a file's path, or a serialised ModelProto
    batches: Mapping[int, int | None]  # a micro-batch count's batch (None: the file's own)
    dims: Mapping[str, int]
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    cost: CostModel
    num_devices: int
    fixed: Mapping[str, Sequence[Sequence[int]]] | None


def wanted() -> bool:
    """Whether a helper may start: more than one core to run it on, and not turned off."""
    if os.environ.get("AUTOPAR_LOOKAHEAD", "1") == "0":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > 1


class Lookahead:
    """The helper process and its answers: one shape asked at a time, the next still open in the
    search's order asked as each answer comes in (by a thread reading them)."""

    def __init__(self, job: Job, shapes: Sequence[PipelineShape]) -> None:
        self._lock = threading.RLock()  # the reader's and the search's; a failed send clears under it too
        self._open = list(shapes)  # not yet asked, nor taken by the search
        self._asked: PipelineShape | None = None
        self._floors: dict[PipelineShape, float | None] = {}
        package = str(Path(__file__).resolve().parents[2])  # this autopar, wherever the caller found it
        paths = os.environ.get("PYTHONPATH")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "autopar.api.lookahead"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": package + (os.pathsep + paths if paths else "")},
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._send(job)
        with self._lock:
            self._ask_next()
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="autopar-lookahead", daemon=True
        )
        self._reader.start()

    def floor(self, shape: PipelineShape) -> float | None:
        """The shape's floor (None: not worked out yet, and the search builds the shape itself: where the
        helper is working on it, the search does not wait, since it may be nearly done or barely started)."""
        with self._lock:
            self.drop(shape)
            return self._floors.get(shape)

    def drop(self, shape: PipelineShape) -> None:
        """The search has no need of this shape's floor (it ruled the shape out otherwise)."""
        with self._lock:
            if shape in self._open:
                self._open.remove(shape)

    def close(self) -> None:
        """Stop the helper (whatever it is working on) and the thread reading it."""
        with self._lock:
            self._open.clear()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._reader.join()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()

    def _ask_next(self) -> None:
        """Ask for the first shape still open (the lock held), saying which micro-batch counts the shapes after
        it need (the helper lets the other models go)."""
        self._asked = self._open.pop(0) if self._open else None
        later = frozenset(shape.micro_batches for shape in self._open)
        if self._asked is not None and not self._send((self._asked, later)):
            self._asked = None

    def _send(self, message: object) -> bool:
        stream = self._process.stdin
        assert stream is not None
        try:
            pickle.dump(message, stream)
            stream.flush()
        except (BrokenPipeError, OSError, ValueError):  # the helper is gone: the search builds every shape
            self._lost()
            return False
        return True

    def _read(self, stream: BinaryIO) -> None:
        while True:
            try:
                shape, seconds = pickle.load(stream)
            except Exception:  # the helper ended (closed, or failed): nothing more comes
                self._lost()
                return
            with self._lock:
                self._floors[shape] = seconds
                self._ask_next()

    def _lost(self) -> None:
        with self._lock:
            self._open.clear()
            self._asked = None


def job_model(model: str | Path | onnx.ModelProto) -> str | bytes:
    """The model as the helper reads it: a file's path, or a ModelProto's bytes."""
    return model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)


def floor_of(job: Job, shape: PipelineShape, graphs: dict[int, Graph]) -> float | None:
    """A pipeline shape's floor (`pipeline_floor`) on its problem as the search builds it (None: the
    problem could not be built, which the search then finds out for itself). ``graphs``: each micro-batch
    count's model, imported once."""
    from autopar.graph import load_model
    from autopar.search.costing import build_problem
    from autopar.search.pipeline import pipeline_floor

    try:
        micro = shape.micro_batches
        if micro not in graphs:
            model = job.model if isinstance(job.model, str) else onnx.load_from_string(job.model)
            graphs[micro] = load_model(
                model, batch=job.batches[micro], dims=dict(job.dims), frozen=job.frozen, trainable=job.trainable
            )
        problem = build_problem(graphs[micro], job.cost, job.num_devices // shape.stages, fixed=job.fixed)
        return pipeline_floor(problem, shape)
    except Exception:  # any refusal is the search's to report, when it builds the shape itself
        return None


def main() -> None:
    """The helper: a `Job`, then shapes (each with the micro-batch counts of the shapes still to come), each
    answered with its floor, until its input ends."""
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    if hasattr(os, "nice"):
        os.nice(19)  # the search's own threads come first: the helper takes the time they leave
    job: Job = pickle.load(source)
    graphs: dict[int, Graph] = {}
    while True:
        try:
            shape, later = pickle.load(source)
        except EOFError:
            return
        pickle.dump((shape, floor_of(job, shape, graphs)), answers)
        answers.flush()
        for micro in set(graphs) - later:
            del graphs[micro]


if __name__ == "__main__":
    main()
