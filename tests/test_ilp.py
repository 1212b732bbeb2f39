"""The ILP cross-check (HiGHS) agrees with the DP, and is exact under a binding memory limit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.cost import CostModel, load_profile
from autopar.graph import load_model
from autopar.search.costing import build_problem
from autopar.search.driver import SearchOptions, run_search
from tests.conftest import every_plan, profile, random_model

pytest.importorskip("highspy")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), devices=st.sampled_from([2, 4, 8]), peak=st.sampled_from([1e6, 1e9]))
def test_ilp_equals_dp_on_random_graphs(seed, devices, peak):
    problem = build_problem(load_model(random_model(seed)), CostModel(profile(peak=peak)), devices)
    dp = problem.objective(run_search(problem, SearchOptions(algorithm="dp")).choice)
    ilp = problem.objective(run_search(problem, SearchOptions(algorithm="ilp")).choice)
    assert ilp == pytest.approx(dp, rel=1e-7, abs=1e-15)


def test_ilp_is_exact_under_a_binding_memory_limit():
    model = random_model(3)
    free = build_problem(load_model(model), CostModel(profile()), 4)
    fastest = free.memory(run_search(free).choice)
    memories = sorted({free.memory(*plan) for plan in every_plan(free)})
    tighter = [m for m in memories if m < fastest]
    if not tighter:
        pytest.skip("no leaner plan exists for this graph")
    capacity = tighter[-1]
    problem = build_problem(load_model(model), CostModel(profile(capacity=capacity)), 4)
    best = min(problem.objective(*plan) for plan in every_plan(problem) if problem.memory(*plan) <= capacity)
    found = run_search(problem, SearchOptions(algorithm="ilp"))
    assert problem.memory(found.choice, found.choices) <= capacity * (1 + 1e-9)
    assert problem.objective(found.choice, found.choices) == pytest.approx(best, rel=1e-7)


def test_ilp_equals_dp_on_resnet50_at_8_devices():
    dp = autopar.plan("models/resnet50.onnx", devices=8)
    ilp = autopar.plan("models/resnet50.onnx", devices=8, search="ilp")
    assert ilp.search.method == "ilp"
    assert ilp.objective == pytest.approx(dp.objective, rel=1e-9)


def test_a_four_layer_gpt_on_sixteen_devices_folded_or_not_equals_the_ilp(monkeypatch):
    from autopar.search import repeats
    from models.transformer import build_preset

    graph = load_model(build_preset("gpt2", layers=4, hidden=256, heads=4, seq=128, batch=8))
    problem = build_problem(graph, CostModel(load_profile("ascend910")), 16)
    exact = problem.objective(run_search(problem, SearchOptions(algorithm="ilp")).choice)
    assert problem.objective(run_search(problem).choice) == pytest.approx(exact, rel=1e-9)
    # fold the layers: three copies from the second layer norm on, and the first layer joins them
    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 2)
    folded = build_problem(graph, CostModel(load_profile("ascend910")), 16)
    assert [(r.period, r.copies, folded.rules[r.start].op.name) for r, _ in folded.folds] == [
        (38, 4, "layer0.ln1")
    ]  # with its fork
    assert problem.objective(run_search(folded).choice) == pytest.approx(exact, rel=1e-9)
