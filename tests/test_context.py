"""`autopar.context`: a plan leaves nothing behind in the process, and two plans never share anything."""

from __future__ import annotations

import collections
import importlib
import json
import pkgutil
import sys
import threading
import weakref

import autopar
from autopar.context import current, opened
from models.transformer import build_transformer
from tests.conftest import profile

RESNET50 = "models/resnet50.onnx"
_CONTAINERS = (dict, list, set, collections.OrderedDict, collections.deque, weakref.WeakKeyDictionary, bytearray)


def _import_everything() -> None:
    for found in pkgutil.walk_packages(autopar.__path__, "autopar."):
        if not found.name.endswith("__main__"):
            try:
                importlib.import_module(found.name)
            except ImportError:  # an optional extra this environment lacks
                continue


def _fingerprint(value: object) -> object:
    """What a container holds, shallowly: its keys and the identity of each value (a value changed in place
    is a value of its own container, fingerprinted there if it is a module's)."""
    if isinstance(value, (dict, collections.OrderedDict)):
        return tuple((repr(key), id(item)) for key, item in value.items())
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(item) for item in value))
    if isinstance(value, weakref.WeakKeyDictionary):
        return len(value)
    return tuple(id(item) for item in value)  # type: ignore[attr-defined]


def _module_state() -> dict[str, object]:
    """Every container held by an autopar module or by a class one defines, fingerprinted."""
    state: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("autopar"):
            continue
        for key, value in vars(module).items():
            if isinstance(value, _CONTAINERS):
                state[f"{name}.{key}"] = _fingerprint(value)
            if isinstance(value, type) and value.__module__ == name:
                for attribute, held in vars(value).items():
                    if isinstance(held, _CONTAINERS) and not attribute.startswith("__"):
                        state[f"{name}.{key}.{attribute}"] = _fingerprint(held)
    return state


def _gpt():
    return build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=8)


def test_a_plan_changes_no_module_state_and_leaves_no_thread():
    """Before and after plans that import, cost, fold, search pipeline shapes and use the DP's threads, every
    container an autopar module or class holds holds the same; no thread of a plan is left running."""
    _import_everything()
    autopar.plan(RESNET50, devices=8)  # anything imported on first use is imported now
    before = _module_state()
    threads = set(threading.enumerate())
    autopar.plan(RESNET50, devices=64)
    autopar.plan(_gpt(), devices=8, pipeline_stages=2, micro_batches=2)
    free = autopar.plan(_gpt(), devices=4, cost_model=profile())
    autopar.plan(_gpt(), devices=4, cost_model=profile(capacity=0.6 * free.memory_per_device))  # memory binds
    after = _module_state()
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    assert not changed
    assert set(threading.enumerate()) <= threads
    assert not current().is_open


def _stripped(plan: autopar.Plan) -> str:
    data = plan.to_dict()
    data["search"].pop("time_s", None)
    data["search"].pop("phases_s", None)
    return json.dumps(data, sort_keys=True)


def test_two_plans_in_two_threads_give_what_each_gives_alone():
    """Each thread opens its own context (caches, pool): plans made side by side equal the plans made alone."""
    cases = {"resnet": lambda: autopar.plan(RESNET50, devices=64), "gpt": lambda: autopar.plan(_gpt(), devices=16)}
    alone = {name: _stripped(make()) for name, make in cases.items()}
    together: dict[str, str] = {}
    failures: list[BaseException] = []

    def run(name: str) -> None:
        try:
            for _ in range(2):
                together[name] = _stripped(cases[name]())
        except BaseException as error:  # reported below, in the test's thread
            failures.append(error)

    workers = [threading.Thread(target=run, args=(name,)) for name in cases]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures and together == alone


def test_a_context_opened_inside_another_is_the_same_and_closes_with_it():
    with opened() as outer:
        assert current() is outer and outer.is_open
        with opened() as inner:
            assert inner is outer
        assert outer.is_open and outer.pool() is not None
    assert not outer.is_open and outer.pool() is None and not outer.eliminations
