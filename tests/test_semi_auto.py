"""Semi-auto mode (fixed strategies, the rest searched) and plans that know what they were made for."""

from __future__ import annotations

import itertools
import json

import pytest

import autopar
from autopar.cost import CostModel
from autopar.errors import FixedStrategyError
from autopar.graph import load_model
from autopar.search.costing import build_problem
from tests.conftest import profile, random_model, run_cli, two_matmul_chain

RESNET50 = "models/resnet50.onnx"


def test_a_fixed_operator_keeps_its_strategy_and_the_rest_is_the_exact_best_around_it():
    model = random_model(7)
    free = build_problem(load_model(model), CostModel(profile()), 4)
    name = free.rules[1].op.name
    strategy = free.rules[1].in_strategy(free.rules[1].candidates[-1])  # its last candidate, rarely the best
    plan = autopar.plan(model, devices=4, cost_model=profile(), mode="semi_auto_parallel", fixed={name: strategy})
    assert plan.strategies[name] == strategy
    assert plan.to_dict()["ops"][1]["fixed"] is True
    ranges = [range(len(free.candidates(i))) for i in range(free.size)]
    best = min(
        free.objective(c)
        for c in itertools.product(*ranges)
        if free.rules[1].in_strategy(free.candidates(1)[c[1]]) == strategy
    )
    assert plan.objective == pytest.approx(best, rel=1e-12)
    assert plan.objective >= autopar.plan(model, devices=4, cost_model=profile()).objective


def test_a_fixed_operator_inside_repeated_blocks_splits_the_run(monkeypatch):
    from autopar.search import repeats
    from models.transformer import build_preset

    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 2)
    graph = load_model(build_preset("gpt2", layers=4, hidden=64, heads=2, seq=16, vocab=128, batch=8))
    fixed = {"layer2.mlp.fc1": ((8, 1, 1), (1, 1))}
    folded = build_problem(graph, CostModel(profile()), 8, fixed=fixed)
    unfolded = build_problem(graph, CostModel(profile()), 8, fold=False, fixed=fixed)
    node = next(i for i, rule in enumerate(folded.rules) if rule.op.name == "layer2.mlp.fc1")
    assert folded.folds, "the other layers still fold"
    assert not any(_covers(repeat, node) for repeat, _ in folded.folds)  # no copy shares its single candidate
    from autopar.search.driver import run_search

    assert folded.objective(run_search(folded).choice) == pytest.approx(
        unfolded.objective(run_search(unfolded).choice), rel=1e-9
    )


def _covers(repeat, node: int) -> bool:
    """Whether ``node`` is inside a copy other than copy 0 (copies share copy 0's candidates)."""
    return any(node in repeat.block(k) for k in range(1, repeat.copies))


def test_resnet50_semi_auto_keeps_the_fixed_conv():
    fixed = {"layer1.0.conv1": ((2, 4, 1, 1), (1, 4, 1, 1))}
    plan = autopar.plan(RESNET50, devices=8, mode="semi_auto_parallel", fixed=fixed)
    assert plan.strategies["layer1.0.conv1"] == ((2, 4, 1, 1), (1, 4, 1, 1))
    assert plan.mode == "semi_auto_parallel"
    assert plan.objective > autopar.plan(RESNET50, devices=8).objective


def test_semi_auto_compares_with_pure_data_parallel_and_states_the_cost_of_what_was_fixed(capsys):
    fixed = {"layer1.0.conv1": ((2, 4, 1, 1), (1, 4, 1, 1))}
    plan = autopar.plan(RESNET50, devices=8, mode="semi_auto_parallel", fixed=fixed)
    free = autopar.plan(RESNET50, devices=8)
    pure = autopar.plan(RESNET50, devices=8, mode="data_parallel")
    totals = plan.to_dict()["totals"]
    assert totals["data_parallel_step_time_s"] == pytest.approx(pure.objective, rel=1e-11)
    assert plan.data_parallel_objective == pytest.approx(pure.objective, rel=1e-12)
    assert totals["speedup_vs_data_parallel"] == pytest.approx(pure.objective / plan.objective, rel=1e-11)
    assert totals["speedup_vs_data_parallel"] < 1  # the fixed conv makes it slower than pure data parallel
    assert totals["free_step_time_s"] == pytest.approx(free.objective, rel=1e-11)
    assert totals["fixed_cost_s"] == pytest.approx(plan.objective - free.objective, rel=1e-9)
    assert totals["fixed_cost_s"] > 1e-3  # about 4.9 ms
    assert "free_step_time_s" not in free.to_dict()["totals"] and "fixed_cost_s" not in free.to_dict()["totals"]

    # the report's baselines are pure too: data parallel splits the fixed conv's batch only
    compared = autopar.api.comparison(plan)
    assert compared.data_parallel.totals.step_time_s == pytest.approx(pure.objective, rel=1e-11)
    assert compared.data_parallel.strategies["layer1.0.conv1"] == ((8, 1, 1, 1), (1, 1, 1, 1))
    assert compared.stand_alone.strategies["layer1.0.conv1"] == ((1, 1, 1, 1), (1, 1, 1, 1))

    code, out, err = run_cli(
        capsys, "plan", RESNET50, "--devices", "8", "--mode", "semi_auto_parallel", "--fix",
        "layer1.0.conv1=((2,4,1,1),(1,4,1,1))",
    )  # fmt: skip
    assert code == 0, err
    ms = f"{pure.objective * 1e3:.3f} ms"
    assert f"vs data parallel: {ms}" in out and "pure data parallel: nothing fixed" in out
    cost, free_ms = (plan.objective - free.objective) * 1e3, free.objective * 1e3
    assert f"fixed:            1 operator cost {cost:.3f} ms a step (this plan minus the {free_ms:.3f} ms" in out


@pytest.mark.parametrize(
    "fix, words",
    [
        ("layer1.0.conv1=((3,1,1,1),(1,1,1,1))", "must be a power of 2, but got 3 for input 0, dimension 0 of"),
        ("layer1.0.conv1=((2,4,1,1),(1,4,1,1),(1,))", "wrong shape"),
        ("layer1.0.conv1=((16,1,1,1),(1,1,1,1))", "more than the 8 devices"),
        ("layer1.0.conv9=((2,1,1,1),(1,1,1,1))", "which the model does not have; did you mean 'layer1.0.conv"),
        ("conv1=((1,2,1,1),(1,2,1,1))", "does not divide"),  # 3 input channels
        ("layer1.0.conv1=(2,", "must be a tuple of integer tuples"),
    ],
)
def test_a_bad_fixed_strategy_is_exit_2_and_one_sentence(capsys, fix, words):
    code, out, err = run_cli(capsys, "plan", RESNET50, "--devices", "8", "--mode", "semi_auto_parallel", "--fix", fix)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("autopar: error:") and words in err


def test_fixed_strategies_from_a_file_and_a_flag(capsys, tmp_path):
    path = tmp_path / "fixed.json"
    path.write_text(json.dumps({"mm1": [[1, 1], [1, 2]], "mm2": [[1, 2], [2, 1]]}))
    model = tmp_path / "chain.onnx"
    import onnx

    onnx.save(two_matmul_chain(), str(model))
    argv = ["plan", model, "--devices", "2", "--mode", "semi_auto_parallel", "--format", "json"]
    code, out, err = run_cli(capsys, *argv, "--strategies", path, "--fix", "mm2=((1,1),(1,1))")
    assert code == 0, err
    ops = {op["name"]: op for op in json.loads(out)["ops"]}
    assert ops["mm1"]["strategy"] == [[1, 1], [1, 2]] and ops["mm2"]["strategy"] == [[1, 1], [1, 1]]
    code, _, err = run_cli(capsys, "plan", model, "--mode", "data_parallel", "--fix", "mm1=((1,1),(1,2))")
    assert code == 2 and "need --mode semi_auto_parallel" in err


def test_fixed_strategies_need_a_searched_mode():
    with pytest.raises(autopar.AutoparError, match="searched mode"):
        autopar.plan(two_matmul_chain(), devices=2, mode="stand_alone", fixed={"mm1": ((1, 1), (1, 1))})
    with pytest.raises(FixedStrategyError, match="does not have"):
        autopar.plan(two_matmul_chain(), devices=2, fixed={"mm3": ((1, 1), (1, 1))})


def test_a_plan_knows_what_it_was_made_for(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, "plan", RESNET50, "--devices", "8", "--format", "json", "--out", path, "--quiet")
    assert code == 0, err
    context = json.loads(path.read_text())["context"]
    assert context["inputs"]["images"] == [256, 3, 224, 224]
    assert len(context["model_fingerprint"]) == 16 and len(context["cost_model_fingerprint"]) == 16
    code, _, err = run_cli(capsys, "verify", RESNET50, "--devices", "8", "--batch", "8", "--plan", path)
    assert code == 1 and "was made for input 'images' of shape [256, 3, 224, 224], not [8, 3, 224, 224]" in err
    code, _, err = run_cli(capsys, "verify", RESNET50, "--devices", "4", "--plan", path)
    assert code == 1 and "is for 8 devices" in err


def test_a_plan_for_another_model_is_refused_by_name(capsys, tmp_path):
    import onnx

    model = tmp_path / "chain.onnx"
    onnx.save(two_matmul_chain(), str(model))
    other = two_matmul_chain(d_hidden=32)  # same operator names, another weight shape
    plan = autopar.plan(other, devices=2, cost_model=profile())
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    code, _, err = run_cli(capsys, "verify", model, "--devices", "2", "--plan", path)
    assert code == 1 and "was made for another model" in err


def test_the_fingerprint_ignores_the_batch_and_weights_but_not_the_structure():
    base = load_model(two_matmul_chain()).fingerprint
    assert load_model(two_matmul_chain(), batch=8).fingerprint == base
    assert load_model(two_matmul_chain(d_out=8)).fingerprint != base
