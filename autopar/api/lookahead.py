"""Models imported and pipeline shapes' floors worked out ahead, in a helper process, while the search runs.

Where memory binds a large model, the search rules most pipeline shapes out by their floors
(`autopar.search.pipeline.pipeline_floor`) before it searches a stage, yet each floor needs the
model imported at the shape's micro-batch and its problem costed: seconds a shape, and most of a
1,024-device plan's time (76.1B GPT: 11 of 15 pipeline shapes). A helper process works the floors out
in the order the search visits the shapes; the search takes the shape of lowest floor in first, and
skips a shape whose floor cannot beat its best plan without building it. Started before the whole
batch is costed, the helper first imports the model at the micro-batch counts the search walks first,
then works out the floors of the pipeline shapes the search would visit, before the search knows it
needs them (the core is otherwise idle while the whole batch is costed). Models are shared both ways
through a folder: each process leaves there the models it imports, and reads back what the other
left (a pickled `Graph` is read back in hundredths of a second; importing takes most of one).

The plan is the same with the helper or without it, whenever its answers arrive: a floor is the
number the search computes itself before it searches a stage, a shape is skipped only where its floor
is clearly no faster than the best plan (a margin far above rounding, so a floor computed in another
process in another order of sums decides nothing the search's own would not), the order shapes are
searched in changes how fast the search is, not what it finds, and a model shared is the one the search
imports. The helper starts only for large models whose batch the search splits, on a machine with more
than one core, and ``AUTOPAR_LOOKAHEAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx

from autopar.context import opened
from autopar.cost import CostModel
from autopar.graph import Graph
from autopar.limits import WORKERS, YOUNG_COLLECTION, lend_cores
from autopar.search.pipeline import PipelineShape

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
    a thread reading them): floors in the search's order, or, while none is open, the models asked for, and
    then the floors guessed."""

    def __init__(
        self,
        job: Job,
        shapes: Sequence[PipelineShape],
        graphs: Sequence[int] = (),
        guessed: Sequence[PipelineShape] = (),
    ) -> None:
        """``graphs``: micro-batch counts whose models the helper imports first, and shares (`graph`);
        ``guessed``: floors worked out after them, until the search says which it needs (`extend`)."""
        self._lock = threading.Condition(threading.RLock())  # the reader's and the search's
        self._open = list(shapes)  # floors not yet asked, nor taken by the search
        self._asked: PipelineShape | int | None = None  # the floor (or the model) the helper is working on
        self._models = list(graphs)  # micro-batch counts whose models are yet to be asked
        self._guessed = list(guessed)  # floors the search may ask for: worked out while nothing else is asked
        self._floors: dict[PipelineShape, float | None] = {}
        self._folder = tempfile.mkdtemp(prefix="autopar-models-")  # models either process imported (`share_model`)
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
        self._send((job, self._folder))
        with self._lock:
            self._ask_next()
        self._reader = threading.Thread(
            target=self._read, args=(self._process.stdout,), name="autopar-lookahead", daemon=True
        )
        self._reader.start()

    def extend(self, shapes: Sequence[PipelineShape]) -> None:
        """More floors to work out, after those asked before (and before any model not yet asked), in place of
        those guessed; a floor answered or under way is not asked again."""
        with self._lock:
            self._guessed.clear()
            known = {*self._open, *self._floors, self._asked}  # asked before, answered, or under way
            self._open.extend(shape for shape in shapes if shape not in known)
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
        """The model at that micro-batch count's size, where the helper has imported it (None: it has not, and
        is no longer asked to: the caller imports it, and shares it, `share_model`)."""
        with self._lock:
            if micro_batches in self._models:
                self._models.remove(micro_batches)
        return shared_model(self._folder, micro_batches)

    def share_model(self, micro_batches: int, graph: Graph) -> None:
        """Leave the helper a model the search imported, so that its floors at that count do not import it again."""
        share_model(self._folder, micro_batches, graph)

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
            self._guessed.clear()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._reader.join()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()
        shutil.rmtree(self._folder, ignore_errors=True)
        self._lend(False)

    def _ask_next(self) -> None:
        """Ask for the first floor still open (the lock held); with none open, the next model; with none left,
        the next floor guessed. The helper has a core of its own while it works out floors the search waits on
        (`share`)."""
        if self._open:
            self._asked = self._open.pop(0)
            request: tuple = ("floor", self._asked)
        elif self._models:
            self._asked = self._models.pop(0)
            request = ("graph", self._asked)
        elif self._guessed:
            self._asked = self._guessed.pop(0)
            request = ("floor", self._asked)
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
                if kind == "floor":
                    self._floors[key] = answer
                self._ask_next()
                self._lock.notify_all()

    def _lost(self) -> None:
        with self._lock:
            self._open.clear()
            self._models.clear()
            self._guessed.clear()
            self._asked = None
            self._lend(False)
            self._lock.notify_all()


def job_model(model: str | Path | onnx.ModelProto) -> str | bytes:
    """The model as the helper reads it: a file's path, or a ModelProto's bytes."""
    return model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)


def shared_model(folder: str, micro_batches: int) -> Graph | None:
    """The model at a micro-batch count's size, where either process left it in ``folder`` (None: neither has)."""
    try:
        with open(_model_path(folder, micro_batches), "rb") as stream:
            graph = pickle.load(stream)
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    return graph if isinstance(graph, Graph) else None


def share_model(folder: str, micro_batches: int, graph: Graph) -> None:
    """Leave a model imported at a micro-batch count's size in ``folder`` for the other process (a pickle is
    read back in hundredths of a second, where importing takes most of one). Written whole, then renamed:
    a reader finds the whole model or none."""
    path = _model_path(folder, micro_batches)
    partial = path.with_suffix(f".{os.getpid()}.part")
    try:
        with open(partial, "wb") as stream:
            pickle.dump(graph, stream, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)
    except OSError:  # the folder is gone (the search ended) or full: the other process imports it itself
        with contextlib.suppress(OSError):
            partial.unlink()


def _model_path(folder: str, micro_batches: int) -> Path:
    return Path(folder) / f"{micro_batches}.graph"


def floor_of(job: Job, shape: PipelineShape, folder: str | None = None) -> float | None:
    """A pipeline shape's floor (`pipeline_floor`) on its problem as the search builds it (None: the
    problem could not be built, which the search then finds out for itself). ``folder``: where the
    models either process imported are (`model_at`)."""
    from autopar.search.costing import build_problem
    from autopar.search.pipeline import pipeline_floor

    try:
        graph = model_at(job, shape.micro_batches, folder)
        return pipeline_floor(build_problem(graph, job.cost, job.num_devices // shape.stages, fixed=job.fixed), shape)
    except Exception:  # any refusal is the search's to report, when it builds the shape itself
        return None


def model_at(job: Job, micro_batches: int, folder: str | None = None) -> Graph:
    """The model at a micro-batch count's size: read back where either process left it in ``folder``, else
    imported (and left there)."""
    from autopar.graph import load_model

    shared = None if folder is None else shared_model(folder, micro_batches)
    if shared is not None:
        return shared
    model = job.model if isinstance(job.model, str) else onnx.load_from_string(job.model)
    graph = load_model(
        model, batch=job.batches[micro_batches], dims=dict(job.dims), frozen=job.frozen, trainable=job.trainable
    )
    if folder is not None:
        share_model(folder, micro_batches, graph)
    return graph


def main() -> None:
    """The helper: a `Job` and the folder models are shared in, then requests until its input ends, each
    answered in turn: a micro-batch count's model (imported and left in the folder), or a shape's floor. No
    model is held between requests: one is read back from the folder in hundredths of a second."""
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    if hasattr(os, "nice"):
        os.nice(19)  # the search comes first: the helper takes the time it leaves
    lend_cores(WORKERS - 1)  # one thread: the helper works on the one core the search leaves it
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_COLLECTION), *older)  # as rarely as the search collects (`planning._Collector`)
    job: Job
    job, folder = pickle.load(source)
    with opened():  # one context for the helper's whole run: the costed pairs serve every floor
        _serve(job, folder, source, answers)


def _serve(job: Job, folder: str, source: BinaryIO, answers: BinaryIO) -> None:
    """Answer the search's requests until its input ends (`main`)."""
    while True:
        try:
            kind, key = pickle.load(source)
        except EOFError:
            return
        if kind == "graph":
            try:
                if not _model_path(folder, key).is_file():  # the search left it already: nothing to read back
                    model_at(job, key, folder)
                answer: bool | float | None = True
            except Exception:  # the search imports it itself, and reports what fails
                answer = None
        else:
            answer = floor_of(job, key, folder)
        pickle.dump((kind, key, answer), answers)
        answers.flush()


if __name__ == "__main__":
    main()
