"""Models imported and pipeline shapes' floors worked out ahead, in a helper process, while the search runs.

Where memory binds a large model, the search rules most pipeline shapes out by their floors
(`autopar.search.pipeline.pipeline_floor`) before it searches a stage, yet each floor needs the
model imported at the shape's micro-batch and its problem costed: seconds a shape, and most of a
1,024-device plan's time (76.1B GPT: 11 of 15 pipeline shapes). A helper process works the floors out
in the order the search visits the shapes; the search takes the shape of lowest floor in first, and
skips a shape whose floor cannot beat its best plan without building it. Started before the whole
batch is costed, the helper first imports the model at each micro-batch count the search will walk
and sends it (a pickled `Graph` is read back in hundredths of a second; importing takes most of one).

The plan is the same with the helper or without it, whenever its answers arrive: a floor is the
number the search computes itself before it searches a stage, a shape is skipped only where its floor
is clearly no faster than the best plan (a margin far above rounding, so a floor computed in another
process in another order of sums decides nothing the search's own would not), the order shapes are
searched in changes how fast the search is, not what it finds, and a model sent is the one the search
imports. The helper starts only for large models whose batch the search splits, on a machine with more
than one core, and ``AUTOPAR_LOOKAHEAD=0`` turns it off.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx

from autopar.cost import CostModel
from autopar.graph import Graph
from autopar.limits import WORKERS, lend_cores
from autopar.search.pipeline import PipelineShape
from autopar.search.problem import SearchProblem

MARGIN = 1e-9
"""How much slower than the best plan (relative) a floor must be for the search to skip its shape: sums
in another order differ in their last bits, far below this."""


@dataclass(frozen=True)
class Job:
    """What the helper needs to import the model and cost a shape's problem as the search would
    (`_Shapes.problem`)."""

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
    """The helper process and its answers: one request at a time, the next sent as each answer comes in (by
    a thread reading them): floors in the search's order, or, while none is open, the models asked for."""

    def __init__(self, job: Job, shapes: Sequence[PipelineShape], graphs: Sequence[int] = ()) -> None:
        """``graphs``: micro-batch counts whose models the helper imports first, and sends (`graph`)."""
        self._lock = threading.Condition(threading.RLock())  # the reader's and the search's
        self._open: list[PipelineShape] = []  # floors not yet asked, nor taken by the search
        self._asked: PipelineShape | int | None = None  # the floor (or the model) the helper is working on
        self._models = list(graphs)  # micro-batch counts whose models are yet to be asked
        self._floors: dict[PipelineShape, float | None] = {}
        self._graphs: dict[int, Graph] = {}  # models imported and sent by the helper, not yet taken
        self._give_back: Callable[[], None] | None = None  # the core lent to the helper (`share`)
        self._sharing = False
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
        self.extend(shapes)
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="autopar-lookahead", daemon=True
        )
        self._reader.start()

    def extend(self, shapes: Sequence[PipelineShape]) -> None:
        """More floors to work out, after those asked before (and before any model not yet asked)."""
        with self._lock:
            self._open.extend(shape for shape in shapes if shape not in self._open)
            if self._asked is None:
                self._ask_next()

    def share(self) -> None:
        """From now, the search's threads leave the helper a core while it works out floors (`limits.workers`):
        the search waits on them. Until then it runs at the lowest priority, in the time the search's threads
        leave (a search that does not wait on floors runs faster on two threads than on one beside the
        helper: the 39.1B GPT's micro-batch counts)."""
        with self._lock:
            self._sharing = True
            self._lend(isinstance(self._asked, PipelineShape))

    def graph(self, micro_batches: int) -> Graph | None:
        """The model at that micro-batch count's size, where the helper has sent it (taken: the caller keeps it;
        where it has not, the helper is no longer asked for it: the caller imports it)."""
        with self._lock:
            if micro_batches in self._models:
                self._models.remove(micro_batches)
            return self._graphs.pop(micro_batches, None)

    def floors(self) -> dict[PipelineShape, float | None]:
        """The floors answered so far (None: the helper could not build the shape)."""
        with self._lock:
            return dict(self._floors)

    def floor(self, shape: PipelineShape) -> float | None:
        """The shape's floor, if answered (None: not yet, or the helper could not build the shape)."""
        with self._lock:
            return self._floors.get(shape)

    def drop(self, shape: PipelineShape) -> None:
        """The search has no need of this shape's floor (it ruled the shape out otherwise)."""
        with self._lock:
            if shape in self._open:
                self._open.remove(shape)

    def take(self, shape: PipelineShape) -> bool:
        """Whether the search may work on ``shape`` itself: its floor is neither answered nor under way (it is
        no longer asked of the helper)."""
        with self._lock:
            self.drop(shape)
            return shape != self._asked and shape not in self._floors

    def wait(self) -> None:
        """Until the helper answers the floor under way (at once where none is)."""
        with self._lock:
            asked = self._asked
            while isinstance(asked, PipelineShape) and self._asked == asked:
                self._lock.wait()

    def close(self) -> None:
        """Stop the helper (whatever it is working on) and the thread reading it, and take its core back."""
        with self._lock:
            self._open.clear()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._reader.join()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()
        self._lend(False)

    def _ask_next(self) -> None:
        """Ask for the first floor still open (the lock held), saying which micro-batch counts the floors after
        it need (the helper lets the other models go); with none open, the next model. The helper has a core
        of its own while it works out floors the search waits on (`share`)."""
        self._models = [micro for micro in self._models if micro not in self._graphs]
        if self._open:
            self._asked = self._open.pop(0)
            request: tuple = ("floor", self._asked, frozenset(shape.micro_batches for shape in self._open))
        elif self._models:
            self._asked = self._models.pop(0)
            request = ("graph", self._asked)
        else:
            self._asked = None
        self._lend(self._sharing and isinstance(self._asked, PipelineShape))
        if self._asked is not None and not self._send(request):
            self._asked = None

    def _lend(self, lent: bool) -> None:
        """Lend the helper a core, or take it back."""
        if lent and self._give_back is None:
            self._give_back = lend_cores(1)
        elif not lent and self._give_back is not None:
            self._give_back()
            self._give_back = None

    def _send(self, message: object) -> bool:
        stream = self._process.stdin
        assert stream is not None
        try:
            pickle.dump(message, stream)
            stream.flush()
        except (BrokenPipeError, OSError, ValueError):  # the helper is gone: the search works without it
            self._lost()
            return False
        return True

    def _read(self, stream: BinaryIO) -> None:
        while True:
            try:
                kind, key, answer = pickle.load(stream)
            except Exception:  # the helper ended (closed, or failed): nothing more comes
                self._lost()
                return
            with self._lock:
                if kind == "graph" and answer is not None:
                    self._graphs[key] = answer
                else:
                    self._floors[key] = answer
                self._ask_next()
                self._lock.notify_all()

    def _lost(self) -> None:
        with self._lock:
            self._open.clear()
            self._models.clear()
            self._asked = None
            self._lend(False)
            self._lock.notify_all()


def job_model(model: str | Path | onnx.ModelProto) -> str | bytes:
    """The model as the helper reads it: a file's path, or a ModelProto's bytes."""
    return model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)


def floor_of(job: Job, shape: PipelineShape, graphs: dict[int, Graph]) -> float | None:
    """A pipeline shape's floor (`pipeline_floor`) on its problem as the search builds it (None: the
    problem could not be built, which the search then finds out for itself). ``graphs``: each micro-batch
    count's model, imported once."""
    from autopar.search.pipeline import pipeline_floor

    try:
        return pipeline_floor(_problem(job, shape, graphs), shape)
    except Exception:  # any refusal is the search's to report, when it builds the shape itself
        return None


def _problem(job: Job, shape: PipelineShape, graphs: dict[int, Graph]) -> SearchProblem:
    from autopar.search.costing import build_problem

    graph = _graph(job, shape.micro_batches, graphs)
    return build_problem(graph, job.cost, job.num_devices // shape.stages, fixed=job.fixed)


def _graph(job: Job, micro: int, graphs: dict[int, Graph]) -> Graph:
    """The model at a micro-batch count's size, imported once (kept in ``graphs``)."""
    from autopar.graph import load_model

    if micro not in graphs:
        model = job.model if isinstance(job.model, str) else onnx.load_from_string(job.model)
        graphs[micro] = load_model(
            model, batch=job.batches[micro], dims=dict(job.dims), frozen=job.frozen, trainable=job.trainable
        )
    return graphs[micro]


def main() -> None:
    """The helper: a `Job`, then requests until its input ends, each answered in turn: a micro-batch count's
    model (imported, kept for the floors, and sent), or a shape's floor (with the micro-batch counts of the
    floors still to come: the other models are let go)."""
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    if hasattr(os, "nice"):
        os.nice(19)  # the search comes first: the helper takes the time it leaves
    lend_cores(WORKERS - 1)  # one thread: the helper works on the one core the search leaves it
    job: Job = pickle.load(source)
    graphs: dict[int, Graph] = {}
    while True:
        try:
            kind, key, *rest = pickle.load(source)
        except EOFError:
            return
        if kind == "graph":
            try:
                answer: Graph | float | None = _graph(job, key, graphs)
            except Exception:  # the search imports it itself, and reports what fails
                answer = None
        else:
            answer = floor_of(job, key, graphs)
            for micro in set(graphs) - rest[0]:
                del graphs[micro]
        pickle.dump((kind, key, answer), answers)
        answers.flush()


if __name__ == "__main__":
    main()
