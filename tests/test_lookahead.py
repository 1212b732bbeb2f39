"""The helper process that imports models and works pipeline shapes' floors out ahead of the search.

A floor it answers is the one the search refutes a shape by before it searches a stage; a model it sends
is the one the search imports; a plan is the same, byte for byte, with the helper or without it; the
helper answers in the order it is asked, skips what the search dropped or took, and neither a model it
cannot import nor its death holds the search up; while it works out floors it has a core of its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import autopar
from autopar import limits
from autopar.api import lookahead, planning
from autopar.api.lookahead import Job, Lookahead, floor_of, job_model, model_at, share_model, shared_model
from autopar.graph import load_model
from autopar.options import PlanOptions
from autopar.search.costing import build_problem
from autopar.search.pipeline import PipelineShape, pipeline_floor, search_stages
from models.transformer import build_transformer
from tests.conftest import profile
from tests.test_pipeline import untimed

SHAPES = [PipelineShape(2, 4), PipelineShape(4, 2), PipelineShape(2, 8)]


def _gpt(batch: int = 64):
    return build_transformer(kind="gpt", layers=8, hidden=64, heads=4, seq=32, vocab=256, batch=batch)


def _costs(**fields):
    return PlanOptions.resolve(8, profile(peak=1e9, **fields), None).costs()


def _job(model, cost, devices: int = 8, batch: int = 64) -> Job:
    return Job(
        model=job_model(model),
        batches={m: batch // m for m in (1, 2, 4, 8)},
        dims={},
        frozen=(),
        trainable=(),
        cost=cost,
        num_devices=devices,
        fixed=None,
    )


def _answered(helper: Lookahead, shape: PipelineShape, timeout: float = 120.0) -> float | None:
    """The helper's floor of ``shape``, once it has answered it or will not (the search itself never waits)."""
    _settle(helper, shape, timeout)
    return helper.floor(shape)


def _settle(helper: Lookahead, shape: PipelineShape | None = None, timeout: float = 120.0) -> None:
    """Until the helper has answered ``shape`` (every floor it has open, for None) or will not."""
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        with helper._lock:
            if shape is None and helper._asked is None and not helper._open and not helper._guessed:
                return
            if shape is not None and (
                shape in helper._floors
                or (shape != helper._asked and shape not in helper._open and shape not in helper._guessed)
            ):
                return
        time.sleep(0.01)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_floor_worked_out_ahead_is_the_one_the_search_refutes_by(monkeypatch, shape):
    """The helper's floor equals the search's own, which refutes the shape at that bound before any stage is
    searched, and which the shape's best plan does not beat."""
    model, cost = _gpt(), _costs()
    job = _job(model, cost)
    problem = build_problem(load_model(model, batch=64 // shape.micro_batches), cost, 8 // shape.stages)
    floor = pipeline_floor(problem, shape)
    assert floor_of(job, shape) == floor
    searched = []
    monkeypatch.setattr("autopar.search.pipeline.run_search", lambda *a, **k: searched.append(a) or None)
    assert search_stages(problem, shape, bound=floor) is None and not searched
    monkeypatch.undo()
    found = search_stages(problem, shape)
    assert found is not None and found.time_s >= floor * (1 - 1e-12)


def test_the_helper_answers_in_the_order_asked_and_skips_what_the_search_dropped_or_took():
    cost = _costs()
    model = _gpt()
    helper = Lookahead(_job(model, cost), SHAPES[:1])
    try:
        helper.extend(SHAPES[1:])
        helper.drop(SHAPES[2])
        assert _answered(helper, SHAPES[0]) == pytest.approx(floor_of(_job(model, cost), SHAPES[0]), rel=1e-12)
        _settle(helper)
        assert helper.floor(SHAPES[1]) == pytest.approx(floor_of(_job(model, cost), SHAPES[1]), rel=1e-12)
        assert helper.floor(SHAPES[2]) is None  # dropped: never asked
        assert not helper.take(SHAPES[1])  # answered: the search takes its floor, not the shape
        helper.extend([PipelineShape(8, 2), PipelineShape(4, 4)])  # the first asked at once, being idle
        assert not helper.take(PipelineShape(8, 2))  # under way: the search leaves it to the helper
        assert helper.take(PipelineShape(4, 4))  # not reached: the search takes it, and the helper never works it out
        _settle(helper)
        assert helper.floor(PipelineShape(8, 2)) is not None and helper.floor(PipelineShape(4, 4)) is None
    finally:
        helper.close()
    assert helper._process.returncode is not None


def test_the_helper_shares_the_models_asked_for_as_the_search_imports_them():
    model, cost = _gpt(), _costs()
    helper = Lookahead(_job(model, cost), (), graphs=[4, 2])
    try:
        ends = time.monotonic() + 120
        while time.monotonic() < ends and (helper._asked is not None or helper._models):
            time.sleep(0.01)
        for micro in (4, 2):  # the same model: the same plan (a pickle's sets follow each process's string hashes)
            shared, imported = helper.graph(micro), load_model(model, batch=64 // micro)
            assert shared is not None and [op.name for op in shared.ops] == [op.name for op in imported.ops]
            plans = [untimed(autopar.plan(g, devices=8, cost_model=profile(peak=1e9))) for g in (shared, imported)]
            assert plans[0] == plans[1]
        assert helper.graph(8) is None  # never asked: the search imports it
    finally:
        helper.close()
    assert not Path(helper._folder).exists()  # the shared models go with the helper


def test_a_model_either_process_imported_is_read_back_not_imported_again(tmp_path):
    """The helper reads back what the search left (a job whose model cannot be imported still gets it); a model
    is written whole before it is seen, and a folder gone or a file cut short reads as none."""
    model = _gpt()
    graph = load_model(model, batch=16)
    broken = Job(b"not a model", {4: 16}, {}, (), (), _costs(), 8, None)
    with pytest.raises(Exception):  # noqa: B017  # nothing there: it imports, and the model is not one
        model_at(broken, 4, str(tmp_path))
    share_model(str(tmp_path), 4, graph)
    assert [p.name for p in tmp_path.iterdir()] == ["4.graph"]  # no partial file left behind
    assert model_at(broken, 4, str(tmp_path)).fingerprint == graph.fingerprint
    imported = model_at(_job(model, _costs()), 2, str(tmp_path))  # imported here, and left for the other
    assert shared_model(str(tmp_path), 2).fingerprint == imported.fingerprint
    (tmp_path / "8.graph").write_bytes((tmp_path / "4.graph").read_bytes()[:1000])
    assert shared_model(str(tmp_path), 8) is None
    assert shared_model(str(tmp_path / "gone"), 4) is None
    share_model(str(tmp_path / "gone"), 4, graph)  # nowhere to leave it: the other process imports it itself


def test_floors_guessed_before_the_search_asks_are_kept_and_not_asked_again():
    model, cost = _gpt(), _costs()
    guessed = [PipelineShape(2, 4), PipelineShape(8, 8), PipelineShape(4, 2)]
    helper = Lookahead(_job(model, cost), (), graphs=[2], guessed=guessed)
    try:
        _settle(helper, guessed[0])
        assert helper.floor(guessed[0]) == pytest.approx(floor_of(_job(model, cost), guessed[0]), rel=1e-12)
        with helper._lock:
            asked = helper._asked
            helper.extend([guessed[0], guessed[2], PipelineShape(2, 8)])  # the search's own list, in its order
            assert helper._guessed == []  # the guesses left are dropped
            assert guessed[0] not in helper._open and asked not in helper._open  # answered, or under way
        _settle(helper)
        assert helper.floor(PipelineShape(2, 8)) is not None and helper.floor(guessed[2]) is not None
    finally:
        helper.close()


class _Untaken:
    """A helper that has reached no shape: the search may take any."""

    def take(self, shape: PipelineShape) -> bool:
        return True


def test_the_search_takes_shapes_of_more_stages_first_leaving_the_helper_the_dearest():
    listed = [PipelineShape(2, 8), PipelineShape(2, 4), PipelineShape(4, 8), PipelineShape(8, 8)]
    take = planning._Shapes._take
    assert take(listed, set(), _Untaken()) == PipelineShape(4, 8)  # of more than the fewest stages, in list order
    assert take(listed, {PipelineShape(4, 8), PipelineShape(8, 8)}, _Untaken()) == PipelineShape(2, 8)
    assert take(listed, set(listed), _Untaken()) is None


def test_the_search_lends_the_helper_a_core_while_it_waits_on_its_floors(monkeypatch):
    monkeypatch.setattr(limits, "WORKERS", 2)
    assert limits.workers() == 2
    helper = Lookahead(_job(_gpt(), _costs()), SHAPES)
    try:
        assert limits.workers() == 2  # floors asked, but not waited on: the search's threads take both cores
        helper.share()
        with helper._lock:  # the helper's core while it works on a floor
            assert limits.workers() == (1 if helper._asked is not None else 2)
        _settle(helper)
        assert limits.workers() == 2  # none left: taken back
        helper.extend([PipelineShape(8, 2)])
    finally:
        helper.close()
    assert limits.workers() == 2


def test_a_model_the_helper_cannot_build_and_a_helper_gone_leave_the_search_to_build_the_shapes():
    cost = _costs()
    broken = Lookahead(Job(b"not a model", {4: 16}, {}, (), (), cost, 8, None), SHAPES[:1])
    try:
        assert _answered(broken, SHAPES[0]) is None
    finally:
        broken.close()
    gone = Lookahead(_job(_gpt(), cost), SHAPES, graphs=[2])
    gone._process.kill()
    gone._process.wait()
    started = time.monotonic()
    try:
        assert [_answered(gone, shape, timeout=30.0) for shape in SHAPES[1:]] == [None, None]
        gone.wait()  # nothing under way: at once
        assert gone.take(SHAPES[2]) and gone.graph(2) is None
    finally:
        gone.close()
    assert time.monotonic() - started < 30.0
    assert limits.workers() == limits.WORKERS  # its core given back


def test_plans_are_the_same_with_shapes_ruled_out_ahead_and_without(monkeypatch):
    """Where memory binds and a pipeline wins, the helper's floors rule shapes out unbuilt, and the plans,
    at several memories, are those the search makes with no helper, byte for byte."""
    ruled_out, pipelined = _with_and_without(monkeypatch, _gpt(), 8, (0.08, 0.1))
    assert any(pipelined)  # a pipeline wins somewhere
    assert any(ruled_out)  # some shape was ruled out by a floor from the helper


def test_plans_of_a_pytorch_export_are_the_same_with_shapes_ruled_out_ahead_and_without(monkeypatch):
    """The same on a torch.export of a Llama module (rotary tables, a shared mask) this project did not
    write, at 16 devices, where memory binds."""
    ruled_out, _ = _with_and_without(monkeypatch, "tests/data/torch_llama_dynamo.onnx", 16, (0.35, 0.25))
    assert any(ruled_out)


def _with_and_without(monkeypatch, model, devices: int, shares) -> tuple[list[bool], list[bool]]:
    """Plan ``model`` at each share of its unconstrained memory with no helper and with one it waits for, and
    check the plans are byte-identical; what the helper's floors ruled out, and where a pipeline won."""
    need = autopar.plan(model, devices=devices, cost_model=profile(peak=1e9)).memory_per_device
    ruled_out, pipelined = [], []
    floors = Lookahead.floors
    chance = planning._Shapes._left_a_chance

    def waiting(self):  # the search takes no floor not yet in: here it waits for all, so the helper is used
        _settle(self)
        return floors(self)

    def judging(self, shape, seconds, best, rank, floor):
        left = chance(self, shape, seconds, best, rank, floor)
        ruled_out.append(seconds is not None and not left and chance(self, shape, None, best, rank, floor))
        return left

    for share in shares:
        cost = profile(capacity=share * need, peak=1e9)
        monkeypatch.setenv("AUTOPAR_LOOKAHEAD", "0")
        alone = autopar.plan(model, devices=devices, cost_model=cost)
        with monkeypatch.context() as patched:
            patched.setenv("AUTOPAR_LOOKAHEAD", "1")
            patched.setattr(lookahead, "wanted", lambda: True)
            patched.setattr(planning, "lookahead_wanted", lambda: True)
            patched.setattr(planning, "LOOKAHEAD_OPERATORS", 0)
            patched.setattr(Lookahead, "floors", waiting)
            patched.setattr(planning._Shapes, "_left_a_chance", judging)
            helped = autopar.plan(model, devices=devices, cost_model=cost)
        assert untimed(helped) == untimed(alone)
        assert limits.workers() == limits.WORKERS  # the helper's core given back
        pipelined.append(alone.file.pipeline is not None)
    return ruled_out, pipelined


def test_the_helper_is_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_LOOKAHEAD", "0")
    assert not lookahead.wanted()
