"""One plan's working state: every cache, pool and thread a plan uses, opened for the plan and closed after it.

A plan imports one file at several batches, costs several problems on one cost model and plans the
elimination of one structure more than once; what it keeps to do that work once (inferred shapes, costed
layout pairs, elimination plans, a pool of threads for large steps) lives here, in the context `opened`
for the plan, and goes when the plan returns. Nothing of one plan is left in the process for the next,
and two plans in two threads never share anything: the open context is a context variable, so each
thread sees its own. A function that keeps something for later asks for the open context (`current`);
called outside any plan (a test costing one problem) it opens one for the call itself.

>>> with opened() as outer:
...     with opened() as inner:
...         inner is outer is current()
True
>>> current().is_open
False
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from autopar.limits import WORKERS, YOUNG_COLLECTION

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(eq=False)
class PlanningContext:
    """The caches, pool and collector setting of one plan (see the module docstring)."""

    eliminations: collections.OrderedDict[bytes, tuple] = field(default_factory=collections.OrderedDict)
    """Elimination plans by the structure they were planned for (`autopar.search.dp.Elimination`)."""
    file_shapes: collections.OrderedDict[bytes, Any] = field(default_factory=collections.OrderedDict)
    """Each file's inferred sizes at its own batch, by its content (`autopar.graph.bind`)."""
    propagated: collections.OrderedDict[bytes, None] = field(default_factory=collections.OrderedDict)
    """The files inferred with data propagation without an error, by their content (`autopar.graph.bind`)."""
    by_cost_model: dict[tuple[str, int], Any] = field(default_factory=dict)
    """Per cost model, what costing keeps of it (`autopar.search.coefficients`), by (kind, the model's id);
    the model itself is held in ``_held`` so that its id stays its own while the plan runs."""
    is_open: bool = False
    _pool: ThreadPoolExecutor | None = None
    _held: list[Any] = field(default_factory=list)

    def for_cost_model(self, kind: str, cost: Any, make: Any) -> Any:
        """What costing keeps of one cost model under ``kind``, made by ``make(cost)`` the first time."""
        key = (kind, id(cost))
        if key not in self.by_cost_model:
            self._held.append(cost)
            self.by_cost_model[key] = make(cost)
        return self.by_cost_model[key]

    def pool(self) -> ThreadPoolExecutor | None:
        """The plan's threads for large steps, started the first time they are wanted (None: no context is
        open, so none would be shut down: the caller works alone)."""
        if not self.is_open:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="autopar-plan")
        return self._pool

    def close(self) -> None:
        """Shut the threads down and drop every cache."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.eliminations.clear()
        self.file_shapes.clear()
        self.propagated.clear()
        self.by_cost_model.clear()
        self._held.clear()
        self.is_open = False


_OPEN: contextvars.ContextVar[PlanningContext | None] = contextvars.ContextVar("autopar_planning", default=None)


def current() -> PlanningContext:
    """The context open in this thread; outside any plan, a closed one for the caller alone (caches that
    last the call, no threads)."""
    return _OPEN.get() or PlanningContext()


@contextlib.contextmanager
def opened() -> Iterator[PlanningContext]:
    """The context of the plan under way in this thread, or a new one for what runs inside, closed after."""
    context = _OPEN.get()
    if context is not None:
        yield context
        return
    context = PlanningContext(is_open=True)
    token = _OPEN.set(context)
    try:
        with _collector.fewer():
            yield context
    finally:
        _OPEN.reset(token)
        context.close()


def planning(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run in the open context, or in one opened for the call (an entry point of a plan's work:
    importing, costing, searching)."""

    @functools.wraps(function)
    def within(*args: P.args, **kwargs: P.kwargs) -> R:
        with opened():
            return function(*args, **kwargs)

    return within


class _Collector:
    """Python's cycle collector, run less often while any plan is under way (in any thread), and as it was
    once none is: the one setting a plan changes outside itself, since the collector is the process's.

    Planning a large model allocates millions of small objects (layouts, rules, factors) and holds
    hundreds of thousands: at the default thresholds the collector ran 4,800 times in a plan of the
    76.1B GPT and walked every object held 22 times, about 7 s of it, to free almost nothing (what a
    search drops is freed as it is dropped: no cycle holds a problem). Less often: under 2 s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans = 0
        self._saved = gc.get_threshold()

    @contextlib.contextmanager
    def fewer(self) -> Iterator[None]:
        with self._lock:
            if not self._plans:
                self._saved = gc.get_threshold()
                young, *older = self._saved
                if young:  # 0: the caller turned automatic collection off
                    gc.set_threshold(max(young, YOUNG_COLLECTION), *older)
            self._plans += 1
        try:
            yield
        finally:
            with self._lock:
                self._plans -= 1
                if not self._plans:
                    gc.set_threshold(*self._saved)


_collector = _Collector()
