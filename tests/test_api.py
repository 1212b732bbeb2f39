"""The Python API: autopar.plan, autopar.candidates, autopar.evaluate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import autopar
from autopar import limits
from autopar.api import choice_for
from autopar.errors import AutoparError, StrategyError
from autopar.graph import Graph, load_model
from models.resnet50 import build_resnet50

REPO = Path(__file__).resolve().parents[1]
RESNET50 = str(REPO / "models" / "resnet50.onnx")
TINY = dict(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1))
# small, but big enough that the best plan mixes data-parallel and whole operators at 4 devices (at batch
# 64, with matmuls costed by their shape, the classifier and the loss go data parallel too)
MIXED = dict(batch=32, num_classes=100, image_size=64, width=16, blocks=(1, 1, 1, 1))


@pytest.fixture(scope="module")
def tiny():
    return build_resnet50(**TINY)


@pytest.fixture(scope="module")
def tiny_graph(tiny) -> Graph:
    return load_model(tiny)


@pytest.fixture(scope="module")
def resnet_graph() -> Graph:
    return load_model(RESNET50)


@pytest.fixture(scope="module")
def resnet_plan():
    return autopar.plan(RESNET50, devices=8)


def _is_strategy(value) -> bool:
    return type(value) is tuple and all(
        type(entry) is tuple and all(type(f) is int and f >= 1 for f in entry) for entry in value
    )


# --- plan.strategies and evaluate ---------------------------------------------------------------


@pytest.mark.parametrize("devices", [4, 8])
def test_strategies_cover_every_op(tiny, tiny_graph, devices):
    plan = autopar.plan(tiny, devices=devices)
    strategies = plan.strategies
    assert type(strategies) is dict
    assert list(strategies) == [op.name for op in tiny_graph.ops]
    for name, strategy in strategies.items():
        assert _is_strategy(strategy), (name, strategy)
        op = tiny_graph.op(name)
        assert len(strategy) == len(op.inputs), name
        for entry in strategy:  # never split one input more ways than there are devices, and only in powers of two
            assert math.prod(entry) <= devices, (name, strategy)
            assert all(f & (f - 1) == 0 for f in entry), (name, strategy)
    assert plan.devices == devices


@pytest.mark.parametrize("devices", [4, 8])
def test_objective_equals_evaluate_tiny(tiny, devices):
    plan = autopar.plan(tiny, devices=devices)
    assert plan.objective > 0
    assert plan.objective == pytest.approx(autopar.evaluate(tiny, devices, plan.strategies), rel=1e-12)


def test_objective_equals_evaluate_resnet50(resnet_plan):
    assert resnet_plan.strategies["conv1"][0][0] in (1, 2, 4, 8)
    assert len(resnet_plan.strategies) == 186
    value = autopar.evaluate(RESNET50, 8, resnet_plan.strategies)
    assert resnet_plan.objective == pytest.approx(value, rel=1e-12)


def test_evaluate_scores_other_assignments_differently(tiny):
    """evaluate is not a constant: stand-alone and data-parallel assignments score as their plans do, but for the
    parallel optimizer, which evaluate takes where it is faster and the data-parallel plan never does (DDP: every
    rank updates every parameter)."""
    values = {}
    for mode in ("stand_alone", "data_parallel"):
        plan = autopar.plan(tiny, devices=4, mode=mode)
        values[mode] = autopar.evaluate(tiny, 4, plan.strategies)
        problem = plan.problem
        assert values[mode] == pytest.approx(problem.objective(plan.choice, problem.fastest_choices(plan.choice)))
        assert values[mode] <= plan.objective * (1 + 1e-12)
    assert values["stand_alone"] != pytest.approx(values["data_parallel"], rel=1e-6)


# --- candidates -------------------------------------------------------------------------------


@pytest.mark.parametrize("which, devices", [("tiny", 4), ("resnet", 8)])
def test_candidates_start_with_data_parallel(which, devices, tiny_graph, resnet_graph):
    graph = tiny_graph if which == "tiny" else resnet_graph
    cands = autopar.candidates(graph, devices)
    assert list(cands) == [op.name for op in graph.ops]
    checked = 0
    for op in graph.ops:
        options = cands[op.name]
        assert options, op.name
        assert len(set(options)) == len(options), f"duplicate candidates for {op.name}"
        assert all(_is_strategy(s) for s in options)
        first_input = graph.tensor(op.inputs[0])
        if first_input.kind not in ("input", "activation") or not first_input.shape:
            continue
        if first_input.shape[0] % devices:
            continue
        first = options[0]
        assert first[0][0] == devices, (op.name, first)
        assert math.prod(first[0]) == devices, (op.name, first)  # nothing but the batch is split
        for name, entry in zip(op.inputs[1:], first[1:]):
            if name and graph.tensor(name).kind in ("parameter", "constant"):
                assert all(f == 1 for f in entry), (op.name, name, entry)
        checked += 1
    assert checked == len(graph.ops)  # every op of ResNet reads a batch-leading tensor first


def test_candidates_contain_the_plan(tiny):
    plan = autopar.plan(tiny, devices=4)
    cands = autopar.candidates(tiny, 4)
    for name, strategy in plan.strategies.items():
        assert strategy in cands[name], name


@pytest.mark.parametrize("config", [TINY, MIXED], ids=["tiny", "mixed"])
def test_plan_is_locally_optimal(config):
    """No single-operator change of candidate beats the searched plan."""
    graph = load_model(build_resnet50(**config))
    devices = 4
    plan = autopar.plan(graph, devices=devices)
    base = plan.strategies
    problem = autopar.build(graph, devices)  # what evaluate scores with, built once for speed
    cands = autopar.candidates(graph, devices)

    def fastest(strategies) -> float:  # the objective with the parallel optimizer where faster, as evaluate takes it
        choice = choice_for(problem, strategies)
        return problem.objective(choice, problem.fastest_choices(choice))

    assert fastest(base) == pytest.approx(plan.objective, rel=1e-12)
    tried = 0
    for name, options in cands.items():
        for option in options:
            if option == base[name]:
                continue
            trial = dict(base)
            trial[name] = option
            value = fastest(trial)
            assert value >= plan.objective * (1 - 1e-9), (name, option, value, plan.objective)
            if tried < 3:  # the shortcut is evaluate itself
                assert autopar.evaluate(graph, devices, trial) == pytest.approx(value, rel=1e-12)
            tried += 1
    assert tried > len(cands)


def test_mixed_plan_is_not_trivial():
    """The MIXED model's plan really mixes strategies, so local optimality above is not vacuous."""
    plan = autopar.plan(build_resnet50(**MIXED), devices=4)
    split = [n for n, s in plan.strategies.items() if any(f > 1 for entry in s for f in entry)]
    assert 0 < len(split) < len(plan.strategies)
    assert plan.objective < plan.data_parallel_objective


# --- evaluate rejects bad strategies -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_base(tiny):
    return autopar.plan(tiny, devices=4, mode="stand_alone").strategies


@pytest.mark.parametrize(
    "op, strategy, words",
    [
        ("conv1", ((3, 1, 1, 1), (1, 1, 1, 1)), "power of 2"),
        ("conv1", ((4, 2, 1, 1), (1, 2, 1, 1)), "more than"),  # 8 parts on 4 devices
        ("layer1.0.conv1", ((4, 2, 1, 1), (2, 2, 1, 1)), "more than"),  # 4 x 2 x 2 parts
        ("conv1", ((1, 2, 1, 1), (1, 2, 1, 1)), "does not divide"),  # 3 input channels
        ("fc", ((1, 1), (4, 1), (4,)), "does not divide"),  # 10 classes
        ("conv1", ((4, 1, 1), (1, 1, 1, 1)), "wrong shape"),
        ("conv1", ((4, 1, 1, 1),), "wrong shape"),
        ("conv1", ((4, 1, 1, 1), (1, 1, 1, 1), (1,)), "wrong shape"),
        ("conv1", 5, "integer"),
        ("conv1", ((1, 1, 2, 1), (1, 1, 1, 1)), "cannot be split"),
    ],
)
def test_evaluate_rejects_bad_strategy(tiny, tiny_base, op, strategy, words):
    strategies = dict(tiny_base)
    strategies[op] = strategy
    with pytest.raises(StrategyError) as info:
        autopar.evaluate(tiny, 4, strategies)
    message = str(info.value)
    assert repr(op) in message
    assert words in message


def test_evaluate_rejects_unknown_op(tiny, tiny_base):
    strategies = dict(tiny_base)
    strategies["no_such_op"] = ((1, 1, 1, 1),)
    with pytest.raises(StrategyError, match="no_such_op"):
        autopar.evaluate(tiny, 4, strategies)


def test_evaluate_rejects_missing_op(tiny, tiny_base):
    strategies = dict(tiny_base)
    del strategies["layer2.0.conv2"]
    with pytest.raises(StrategyError, match=r"layer2\.0\.conv2"):
        autopar.evaluate(tiny, 4, strategies)


def test_strategy_errors_are_autopar_errors():
    assert issubclass(StrategyError, AutoparError)


def test_evaluate_rejects_non_integer_factor(tiny, tiny_base):
    strategies = dict(tiny_base)
    strategies["conv1"] = ((2.5, 1, 1, 1), (1, 1, 1, 1))
    with pytest.raises(StrategyError, match="conv1"):
        autopar.evaluate(tiny, 4, strategies)


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [0, 3, 6, -8, True, 4.0])
def test_devices_must_be_a_power_of_two(tiny_graph, tiny_base, devices):
    with pytest.raises(AutoparError, match="power of two"):
        autopar.plan(tiny_graph, devices=devices)
    with pytest.raises(AutoparError, match="power of two"):
        autopar.candidates(tiny_graph, devices)
    with pytest.raises(AutoparError, match="power of two"):
        autopar.evaluate(tiny_graph, devices, tiny_base)


def test_unknown_mode(tiny_graph):
    with pytest.raises(AutoparError, match="hybrid"):
        autopar.plan(tiny_graph, devices=4, mode="hybrid")


def test_unknown_precision_and_search(tiny_graph):
    with pytest.raises(AutoparError, match="fp8"):
        autopar.plan(tiny_graph, devices=4, precision="fp8")
    with pytest.raises(AutoparError, match="beam"):
        autopar.plan(tiny_graph, devices=4, search="beam")


def test_options_are_one_checked_frozen_value(tiny_graph):
    import dataclasses

    from autopar.options import DEFAULT_DEVICES, Mode, PlanOptions, Precision, SearchAlgorithm

    options = PlanOptions.resolve(mode="data_parallel", precision="fp32", frozen="w*")
    assert options.num_devices == DEFAULT_DEVICES == 8
    assert (options.mode, options.precision, options.search) == (Mode.DATA_PARALLEL, Precision.FP32, SearchAlgorithm.DP)
    assert options.mode == "data_parallel" and options.frozen == ("w*",)  # str-valued: the names still compare
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_devices = 16  # type: ignore[misc]
    with pytest.raises(AutoparError, match=r"^Unknown mode 'hybrid'; choose one of: auto_parallel, "):
        PlanOptions(mode="hybrid")  # type: ignore[arg-type]
    with pytest.raises(AutoparError, match="power of two"):
        options.replace(num_devices=6)
    with pytest.raises(AutoparError, match=r"^The runtime must be 'virtual' or 'torch', got 'cuda'\.$"):
        autopar.verify(tiny_graph, None, devices=4, runtime="cuda")
    by_enum = autopar.plan(tiny_graph, devices=4, mode=Mode.DATA_PARALLEL)
    by_name = autopar.plan(tiny_graph, devices=4, mode="data_parallel")
    assert (by_enum.strategies, by_enum.objective) == (by_name.strategies, by_name.objective)
    assert by_enum.mode == by_name.mode == "data_parallel"


# --- the bundled ResNet-50 ----------------------------------------------------------------------


def test_auto_parallel_not_worse_than_data_parallel(resnet_plan, resnet_graph):
    data_parallel = autopar.plan(resnet_graph, devices=8, mode="data_parallel")
    assert resnet_plan.objective <= data_parallel.objective
    assert data_parallel.objective == pytest.approx(resnet_plan.data_parallel_objective, rel=1e-12)
    for name, strategy in data_parallel.strategies.items():
        if resnet_graph.op(name).op_type == "Conv":
            assert strategy == ((8, 1, 1, 1), (1, 1, 1, 1)), name


# --- serialisation ------------------------------------------------------------------------------


def test_to_dict_round_trips_through_json_resnet50(resnet_plan):
    data = resnet_plan.to_dict()
    again = json.loads(json.dumps(data, allow_nan=False))
    assert again == data
    assert data["schema"] == "autopar.plan/3"
    assert [op["name"] for op in data["ops"]] == list(resnet_plan.strategies)
    for entry in data["ops"]:
        assert [tuple(s) for s in entry["strategy"]] == list(resnet_plan.strategies[entry["name"]])
    assert data["objective_s"] == pytest.approx(resnet_plan.objective, rel=1e-11)


@pytest.mark.parametrize("mode", ["auto_parallel", "data_parallel", "stand_alone"])
def test_to_dict_round_trips_through_json_tiny(tiny, mode):
    plan = autopar.plan(tiny, devices=4, mode=mode)
    data = plan.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["mode"] == mode
    assert json.loads(plan.to_json()) == data


def test_a_plan_prints_what_the_terminal_shows(capsys):
    from autopar.cli import main

    plan = autopar.plan(RESNET50, devices=8)
    assert main(["plan", RESNET50, "--devices", "8"]) == 0
    assert str(plan) == plan.summary() == capsys.readouterr().out
    assert "fc " in str(plan) and plan.summary(top=None).count("\n") > 186


def test_a_plan_writes_its_report(tmp_path):
    plan = autopar.plan(RESNET50, devices=8)
    written = plan.report(tmp_path / "page.html")
    page = written.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and "Why not data parallel" in page


def test_a_sweep_is_a_value_that_shows_itself(tmp_path):
    points = autopar.sweep(RESNET50, [1, 8])
    assert isinstance(points, autopar.Sweep) and len(points) == 2 and points[1]["devices"] == 8
    assert [p["devices"] for p in points] == [1, 8] and points.to_list() == list(points)
    assert json.loads(json.dumps(points.to_list()))[0]["devices"] == 1
    assert str(points).splitlines()[0].split()[:3] == ["devices", "batch", "step"]
    assert points._repr_html_().startswith("<iframe srcdoc=")
    assert points.report(tmp_path / "sweep.html").read_text(encoding="utf-8").startswith("<!doctype html>")


def test_a_verify_report_prints_its_table():
    report = autopar.verify(RESNET50, autopar.plan(RESNET50, devices=8, batch=2), devices=8, batch=2)
    assert str(report).startswith("autopar verify: VERIFIED on 8 virtual devices")


def test_a_plan_runs_the_cycle_collector_less_often_and_leaves_it_as_it_was(tiny, monkeypatch):
    """While a plan is searched the youngest generation is collected after far more allocations than
    Python's default (nothing a search drops waits for the collector); once the plan is made, or refused,
    the thresholds are the caller's again."""
    import gc

    from autopar.search.shape_search import ShapeSearch

    during: list[tuple[int, ...]] = []
    search = ShapeSearch.search
    monkeypatch.setattr(ShapeSearch, "search", lambda self: during.append(gc.get_threshold()) or search(self))
    before = gc.get_threshold()
    autopar.plan(tiny, devices=4)
    assert gc.get_threshold() == before
    assert during[0][0] >= max(limits.YOUNG_COLLECTION, before[0]) and during[0][1:] == before[1:]
    with pytest.raises(AutoparError):
        autopar.plan(tiny, devices=4, fixed={"no_such_op": ((1, 1, 1, 1),)})
    assert gc.get_threshold() == before


def test_an_import_error_kept_for_later_holds_no_frames():
    """A shape's refusal is kept (`ShapeSearch._refusals`) without the traceback of its raising or of the error
    it was raised handling: their frames hold the search that keeps it."""
    from autopar.errors import ModelImportError
    from autopar.search.shape_search import _detached

    try:
        try:
            raise ValueError("inner")
        except ValueError:
            raise ModelImportError("The model does not import.") from None
    except ModelImportError as error:
        kept = _detached(error)
    assert kept.__traceback__ is None and kept.__context__ is None and str(kept) == "The model does not import."


# --- arguments of the wrong type: one sentence, an AutoparError, never a TypeError from inside ----


COST_SAID = "cost_model must be a bundled profile's name, a .toml file's path or a HardwareProfile, got {}."
MODEL_SAID = "The model must be an ONNX file's path, an onnx.ModelProto or an imported Graph, got {}."
THREE_STAGES = "2 stage starts make 3 pipeline stages; the stage count must be a power of two (1, 2, 4, ...)."
PLAN_SAID = (
    "plan_or_strategies must be a Plan, a plan file (a PlanFile, its dict or its path), a mapping"
    " {operator: in_strategy} or None, got 3."
)


def _refused(message, call, *args, **keywords):
    """``call`` raises an AutoparError whose message is ``message``, exactly."""
    with pytest.raises(AutoparError) as caught:
        call(*args, **keywords)
    assert str(caught.value) == message
    return caught.value


@pytest.fixture(scope="module")
def tiny_plan(tiny):
    return autopar.plan(tiny, devices=4)


@pytest.mark.parametrize(
    "keywords, message",
    [
        ({"cost_model": 3}, COST_SAID.format(3)),
        ({"cost_model": None}, COST_SAID.format(None)),
        ({"dims": [1]}, "dims must be a mapping {dimension name: size}, got [1]."),
        ({"dims": "x=4"}, "dims must be a mapping {dimension name: size}, got 'x=4'."),
        ({"fixed": ["conv1"]}, "fixed must be a mapping {operator: in_strategy}, got ['conv1']."),
        ({"frozen": 3}, "frozen must be a name or a list of names, got 3."),
        ({"frozen": None}, "frozen must be a name or a list of names, got None."),
        ({"trainable": None}, "trainable must be a name or a list of names, got None."),
        ({"stage_starts": None}, "stage_starts must be a name or a list of names, got None."),
        ({"rank_table": 3}, "rank_table must be a rank_table.json path or its parsed JSON, got 3."),
        ({"overlap": "no"}, "overlap must be True or False, got 'no'."),
        ({"recompute": "yes"}, "recompute must be True, False or None, got 'yes'."),
    ],
)
def test_a_plan_argument_of_the_wrong_type_is_one_sentence(tiny_graph, keywords, message):
    _refused(message, autopar.plan, tiny_graph, devices=4, **keywords)


def test_a_model_of_the_wrong_type_is_one_sentence(tiny, tiny_plan):
    for model, shown in [(42, "42"), (None, "None"), (b"onnx", "b'onnx'"), ([1], "[1]")]:
        _refused(MODEL_SAID.format(shown), autopar.plan, model, devices=4)
    _refused(MODEL_SAID.format("a bytes object"), autopar.plan, tiny.SerializeToString(), devices=4)
    _refused(MODEL_SAID.format("None"), autopar.candidates, None, 4)
    _refused(MODEL_SAID.format("42"), autopar.verify, 42, tiny_plan, devices=4)


def test_other_entry_points_refuse_wrong_types_in_one_sentence(tiny_graph, tiny_plan):
    said = "strategies must be a mapping {operator: in_strategy}, got {}."
    _refused(said.replace("{}", "3"), autopar.evaluate, tiny_graph, 4, 3)
    _refused(said.replace("{}", "None"), autopar.evaluate, tiny_graph, 4, None)
    _refused("dims must be a mapping {dimension name: size}, got [1].", autopar.candidates, tiny_graph, 4, dims=[1])
    _refused(PLAN_SAID, autopar.verify, tiny_graph, 3, devices=4)
    _refused(
        "gradients must be True, False or None, got 'yes'.", autopar.verify, tiny_graph, tiny_plan, gradients="yes"
    )
    _refused(
        "timeout_s must be a number of seconds above 0 or None, got 0.",
        autopar.verify,
        tiny_graph,
        tiny_plan,
        timeout_s=0,
    )


@pytest.mark.parametrize(
    "devices, keywords, message",
    [
        (8, {"stage_starts": ["a", "b"]}, THREE_STAGES),
        (8, {"stage_starts": ["a", "a"]}, "The stage start 'a' is named twice; each stage starts at its own operator."),
        (
            2,
            {"stage_starts": ["a", "b", "c"]},
            "3 stage starts make 4 pipeline stages, more than the 2 devices: each stage needs one.",
        ),
        (4, {"stage_starts": "a", "pipeline_stages": 4}, "1 stage start makes 2 pipeline stages, not the 4 asked for."),
        (2, {"pipeline_stages": 16}, "16 pipeline stages cannot run on 2 devices: each stage needs one."),
        (2, {"pipeline_stages": 3}, "The pipeline stage count must be a power of two (1, 2, 4, ...), got 3."),
    ],
)
def test_stage_counts_are_said_in_stages_and_starts(tiny_graph, devices, keywords, message):
    _refused(message, autopar.plan, tiny_graph, devices=devices, **keywords)


def test_the_cli_says_what_its_stage_starts_make(capsys):
    from autopar.cli import main

    assert main(["plan", RESNET50, "--stage-starts", "a,b", "--quiet"]) == 1
    assert capsys.readouterr().err == f"autopar: error: {THREE_STAGES}\n"


def test_verify_and_export_read_a_plan_file_by_its_path(tiny, tiny_plan, tmp_path):
    from autopar.errors import PlanFileError

    path = tmp_path / "plan.json"
    path.write_text(tiny_plan.to_json(), encoding="utf-8")
    assert autopar.verify(tiny, str(path), devices=4).ok and autopar.verify(tiny, path, devices=4).ok
    assert autopar.export_plan(str(path), "jax", tmp_path / "plan_jax.py") == [tmp_path / "plan_jax.py"]
    missing = str(tmp_path / "missing.json")
    error = _refused(f"Plan file {missing!r} does not exist.", autopar.export_plan, missing, "jax")
    assert isinstance(error, PlanFileError)
    said = "The plan to export must be a Plan, a PlanFile, a plan file's dict or its path, got 3."
    _refused(said, autopar.export_plan, 3, "jax", tmp_path / "x.py")
    said = "The export format (to) must be a name such as 'onnx' or 'dtensor', got ['jax']."
    _refused(said, autopar.export_plan, tiny_plan, ["jax"], tmp_path / "x.py")


def test_sweep_takes_one_count_and_refuses_none(tiny):
    assert [point["devices"] for point in autopar.sweep(tiny, 4)] == [4]
    _refused("devices names no device count to sweep; give at least one, such as [1, 8, 64].", autopar.sweep, tiny, [])
    said = "devices must be a device count or a list of them, such as [1, 8, 64], got '8'."
    _refused(said, autopar.sweep, tiny, "8")
    _refused("The device count must be a power of two (1, 2, 4, 8, ...), got 3.", autopar.sweep, tiny, [1, 3])
    _refused("devices names 4 more than once, got [4, 1, 4].", autopar.sweep, tiny, [4, 1, 4])  # as the CLI says


def test_a_report_to_a_directory_is_one_sentence(tiny, tiny_plan, tmp_path):
    said = f"Cannot write the report to {str(tmp_path)!r}: it is a directory; name a file to write."
    _refused(said, tiny_plan.report, tmp_path)
    _refused(said, autopar.sweep(tiny, 4).report, str(tmp_path))
    missing = tmp_path / "no" / "page.html"
    _refused(f"Cannot write the report to {str(missing)!r}: No such file or directory.", tiny_plan.report, missing)
