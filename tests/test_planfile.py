"""The typed plan file: a real plan round-trips; a broken file is refused in one sentence naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import onnx
import pytest

import autopar
from autopar.cli import main
from autopar.errors import PlanFileError
from autopar.lowering import SCHEMA, PlanFile, json_schema, load_plan_file, read_plan_file
from tests.conftest import RESNET50, two_matmul_chain

DEVICES = 4


@pytest.fixture(scope="module")
def plan():
    return autopar.plan(two_matmul_chain(), devices=DEVICES)


@pytest.fixture
def model_and_plan(tmp_path, plan):
    """A model file and the real plan's JSON dict for it."""
    model_path = tmp_path / "chain.onnx"
    onnx.save(two_matmul_chain(), str(model_path))
    data = autopar.plan(model_path, devices=DEVICES).to_dict()
    assert data == plan.to_dict() | {"model": data["model"], "search": data["search"]}
    return model_path, data


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_real_plan_round_trips(plan):
    data = plan.to_dict()
    assert data["schema"] == SCHEMA and data["devices"] == DEVICES
    assert [op["name"] for op in data["ops"]] == ["mm1", "mm2"]
    parsed = read_plan_file(data)
    assert isinstance(parsed, PlanFile)
    assert parsed.dump() == data
    assert parsed == plan.file
    assert parsed.strategies == plan.strategies
    # and through JSON text, as a file gives it
    assert read_plan_file(json.loads(json.dumps(data))).dump() == data
    assert plan.to_dict() is not plan.to_dict()  # a fresh copy each call


def test_a_plan_file_reads_back_from_disk(tmp_path, plan):
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert load_plan_file(path).dump() == plan.to_dict()


def _broken(data: dict, how: str) -> dict:
    data = copy.deepcopy(data)
    if how == "no_strategy":
        del data["ops"][0]["strategy"]
    elif how == "strategy_int":
        data["ops"][0]["strategy"] = 4
    elif how == "redistributions_string":
        data["redistributions"] = "garbage"
    elif how == "no_ops":
        del data["ops"]
    else:
        raise AssertionError(how)
    return data


def _assert_one_line_error(code: int, err: str) -> str:
    assert code == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("autopar: error:"), err
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "how, field",
    [
        ("no_strategy", "strategy"),
        ("strategy_int", "strategy"),
        ("redistributions_string", "redistributions"),
        ("no_ops", "ops"),
    ],
)
def test_broken_plan_files_are_refused_naming_the_field(tmp_path, capsys, model_and_plan, how, field):
    model_path, data = model_and_plan
    broken = tmp_path / "broken.json"  # a name that spells no field
    broken.write_text(json.dumps(_broken(data, how)))
    line = _assert_one_line_error(*run(capsys, "verify", model_path, "--devices", DEVICES, "--plan", broken)[::2])
    assert str(broken) in line
    assert field in line.replace(str(broken), "")
    with pytest.raises(PlanFileError, match=field):
        read_plan_file(_broken(data, how))


def test_deeply_nested_plan_file_is_refused(tmp_path, capsys, model_and_plan):
    model_path, _ = model_and_plan
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    line = _assert_one_line_error(*run(capsys, "verify", model_path, "--devices", DEVICES, "--plan", deep)[::2])
    assert str(deep) in line


def test_directory_as_plan_file_is_refused(tmp_path, capsys, model_and_plan):
    model_path, _ = model_and_plan
    line = _assert_one_line_error(*run(capsys, "verify", model_path, "--devices", DEVICES, "--plan", tmp_path)[::2])
    assert str(tmp_path) in line


def test_unknown_schema_is_refused_naming_it(tmp_path, capsys, model_and_plan):
    model_path, data = model_and_plan
    other = tmp_path / "future.json"
    other.write_text(json.dumps(data | {"schema": "autopar.plan/99"}))
    line = _assert_one_line_error(*run(capsys, "verify", model_path, "--devices", DEVICES, "--plan", other)[::2])
    assert "autopar.plan/99" in line.replace(str(other), "")


def test_the_unbroken_plan_file_verifies(tmp_path, capsys, model_and_plan):
    pytest.importorskip("onnxruntime")
    model_path, data = model_and_plan
    good = tmp_path / "good.json"
    good.write_text(json.dumps(data))
    code, _, err = run(capsys, "verify", model_path, "--devices", DEVICES, "--plan", good)
    assert code == 0, err
    assert err == ""


def test_schema_command_prints_the_json_schema(capsys):
    code, out, err = run(capsys, "schema")
    assert code == 0, err
    schema = json.loads(out)
    assert {"ops", "redistributions"} <= set(schema["properties"])
    assert schema == json_schema()
    assert set(schema["required"]) >= {"schema", "ops", "redistributions"}


# --- a file edited into nonsense: refused when read, one sentence naming the field and what it found ------------


def _op(data: dict, name: str) -> dict:
    return next(op for op in data["ops"] if op["name"] == name)


EDITS = {
    "precision": (lambda d: d.update(precision="fp16"), ["precision", "'mixed', 'fp32' or 'fp8'", "'fp16'"]),
    "mode": (lambda d: d.update(mode="weird"), ["mode", "'auto_parallel'", "'weird'"]),
    "optimizer": (lambda d: d.update(optimizer="lamb"), ["optimizer", "'adam' or 'sgd'", "'lamb'"]),
    "devices_string": (lambda d: d.update(devices="4"), ["devices: an integer is expected, not '4'"]),
    "devices_float": (lambda d: d.update(devices=4.0), ["devices: an integer is expected, not 4.0"]),
    "seconds_string": (lambda d: d.update(objective_s="1.5"), ["objective_s: a number is expected, not '1.5'"]),
    "bit_string": (
        lambda d: _op(d, "mm1")["inputs"][0]["layout"].update(dims=[["0"], []]),
        ["ops.0.inputs.0.layout.dims.0.0 (operator 'mm1')", "an integer is expected, not '0'"],
    ),
    "fallback_number": (lambda d: _op(d, "mm2").update(fallback=0), ["ops.1.fallback (operator 'mm2')", "not 0"]),
    "mesh_bits": (lambda d: d.update(mesh_bits=5), ["devices is 4 but mesh_bits is 5"]),
    "devices": (lambda d: d.update(devices=8), ["devices is 8 but mesh_bits is 2"]),
    "devices_odd": (lambda d: d.update(devices=6), ["devices is 6, not a power of two"]),
    "bit_twice": (
        lambda d: _op(d, "mm1")["inputs"][0]["layout"].update(dims=[[0], [0]]),
        ["ops.0.inputs.0.layout (operator 'mm1')", "mesh bit 0 is used twice in the layout [[0], [0]]"],
    ),
    "partial_bit_twice": (
        lambda d: _op(d, "mm2")["outputs"][0]["layout"].update(dims=[[1], []], partial=[1], partial_op="sum"),
        ["ops.1.outputs.0.layout (operator 'mm2')", "mesh bit 1 is used twice"],
    ),
    "bit_outside": (
        lambda d: (
            _op(d, "mm1")["inputs"][0]["layout"].update(dims=[[7], []]),
            _op(d, "mm1").update(strategy=[[2, 1], *_op(d, "mm1")["strategy"][1:]]),
        ),  # the strategy as the layout says
        ["input 'X' of operator 'mm1' uses mesh bit 7", "4 devices have mesh bits 0 to 1"],
    ),
    "sync_bit_outside": (
        lambda d: d["gradient_sync"][0].update(bits=[2]),
        ["the gradient sync of 'W1' uses mesh bit 2"],
    ),
    "link_bit_outside": (lambda d: d["links"][0].update(bits=[0, 1, 2]), ["links: the HCCS link names mesh bit 2"]),
    "split_three": (
        lambda d: _op(d, "mm1").update(strategy=[[3, 1], [1, 1]]),
        ["ops.0.strategy (operator 'mm1')", "input 0 is split 3 ways ([3, 1]), not a power of two"],
    ),
    "split_too_many": (
        lambda d: _op(d, "mm2").update(strategy=[[1, 1], [4, 4]]),  # more than the 4 devices, and its layout
        ["ops.1 (operator 'mm2')", "the strategy splits input 'W2' as [4, 4], but its recorded layout [[], []]"],
    ),
    "strategy_rank": (
        lambda d: _op(d, "mm1").update(strategy=[[1], [1, 1]]),
        ["ops.0 (operator 'mm1')", "tuple [1] for input 'X' has 1 entry, but its recorded layout [[], []] has 2"],
    ),
    "strategy_short": (
        lambda d: _op(d, "mm1").update(strategy=[[1, 1]]),
        ["ops.0 (operator 'mm1')", "the strategy has no tuple for input 'W1'"],
    ),
    "strategy_long": (
        lambda d: _op(d, "mm1").update(strategy=[[1, 1], [1, 1], [1]]),
        ["ops.0 (operator 'mm1')", "a tuple [1] beyond the 2 inputs it records"],
    ),
}


@pytest.mark.parametrize("how", sorted(EDITS))
def test_an_edited_plan_file_is_refused_when_read(plan, how):
    edit, said = EDITS[how]
    data = copy.deepcopy(plan.to_dict())
    edit(data)
    with pytest.raises(PlanFileError) as caught:
        read_plan_file(data, origin="p.json")
    message = str(caught.value)
    assert message.startswith("Plan file 'p.json' is not a valid autopar plan: ") and message.count(". ") == 0
    for part in said:
        assert part in message, message


@pytest.mark.parametrize("how", ["precision", "bit_twice", "bit_outside", "mesh_bits", "split_three", "strategy_rank"])
@pytest.mark.parametrize("command", ["verify", "report", "export"])
def test_every_command_refuses_an_edited_plan_file_in_the_same_sentence(tmp_path, capsys, model_and_plan, how, command):
    model_path, data = model_and_plan
    edit, said = EDITS[how]
    edit(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    argv = {
        "verify": ["verify", model_path, "--devices", DEVICES, "--plan", edited],
        "report": ["report", model_path, "--plan", edited, "-o", tmp_path / "r.html"],
        "export": ["export", edited, "--to", "mindspore", "-o", tmp_path / "s.ckpt"],
    }[command]
    line = _assert_one_line_error(*run(capsys, *argv)[::2])
    assert f"Plan file {str(edited)!r} is not a valid autopar plan" in line
    assert all(part in line for part in said), line


def test_the_plan_files_modes_are_the_options_modes_and_given():
    from typing import get_args

    from autopar.options import Mode

    modes = set(get_args(PlanFile.model_fields["mode"].annotation))
    assert modes == {mode.value for mode in Mode} | {"given"}


def test_a_pipelined_plan_and_older_schemas_still_read():
    from tests.conftest import export_gpt

    piped = autopar.plan(export_gpt(), devices=8, pipeline_stages=2).to_dict()
    assert piped["pipeline"] is not None and read_plan_file(piped).dump() == piped
    older = {key: value for key, value in piped.items() if key not in ("pipeline", "gradients", "context")}
    for schema in ("autopar.plan/1", "autopar.plan/2"):
        assert read_plan_file(older | {"schema": schema}).schema_ == schema


# --- a plan read against a model: each operator is the model's ------------------------------------------------


def _renamed_chain() -> onnx.ModelProto:
    model = two_matmul_chain()
    model.graph.node[1].name = "other"
    return model


MODEL_EDITS = {
    "another_model": (lambda d: None, "The plan lists operator 'mm2' (MatMul), which model"),
    "op_type": (lambda d: _op(d, "mm1").update(op_type="Gemm"), "The plan's operator 'mm1' is a Gemm, but in model"),
    "operator_missing": (lambda d: d["ops"].pop(1), "The plan has no strategy for operator 'mm2' of model"),
    "split_differs": (
        lambda d: _op(d, "mm1").update(strategy=[[2, 1], [1, 1]]),
        "(operator 'mm1'): the strategy splits input 'X' as [2, 1], but its recorded layout [[], []] splits it as"
        " [1, 1]",
    ),
}


@pytest.mark.parametrize("how", sorted(MODEL_EDITS))
def test_a_plan_without_its_context_is_still_checked_against_the_model(tmp_path, capsys, model_and_plan, how):
    model_path, data = model_and_plan
    edit, said = MODEL_EDITS[how]
    del data["context"]
    edit(data)
    if how == "another_model":  # the same file, reported against another model
        onnx.save(_renamed_chain(), str(model_path))
    plan_path = tmp_path / "old.json"
    plan_path.write_text(json.dumps(data))
    for argv in (
        ["report", model_path, "--plan", plan_path, "-o", tmp_path / "r.html"],
        ["verify", model_path, "--devices", DEVICES, "--plan", plan_path],
        ["export", plan_path, "--to", "mindspore", "--model", model_path, "-o", tmp_path / "s.ckpt"],
    ):
        line = _assert_one_line_error(*run(capsys, *argv)[::2])
        assert said in line, line
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "s.ckpt").exists()


def test_check_context_refuses_a_strategy_of_the_wrong_shape_for_the_model(plan):
    from autopar.graph import load_model
    from autopar.lowering.lower import check_context

    graph = load_model(two_matmul_chain())
    check_context(plan.file, graph, DEVICES)
    edited = plan.to_dict()
    del edited["context"]
    _op(edited, "mm1").update(
        strategy=[[1, 1, 1], [1, 1]],
        inputs=[{"tensor": "X", "layout": {"dims": [[], [], []]}}, *_op(edited, "mm1")["inputs"][1:]],
    )
    with pytest.raises(PlanFileError, match=r"strategy \[\[1, 1, 1\], \[1, 1\]\] for 'mm1' \(MatMul\) does not fit"):
        check_context(read_plan_file(edited), graph, DEVICES)


def test_a_fork_splitting_its_gradient_more_ways_than_the_devices_is_refused_when_read():
    """A fork's last tuple (its gradient's splits) has no recorded layout to agree with: its ways are checked alone."""
    data = autopar.plan(RESNET50.parents[1] / "tests" / "data" / "torch_llama_dynamo.onnx", devices=8).to_dict()
    fork = next(op for op in data["ops"] if op.get("domain"))
    fork["strategy"][-1] = [16] * len(fork["strategy"][-1])
    with pytest.raises(PlanFileError, match=rf"operator {fork['name']!r} splits input 1 16 ways \(\[16\]\), more than"):
        read_plan_file(data)


def test_a_plan_from_before_forks_is_checked_against_the_model_without_them():
    """autopar inserts forks where readers split one tensor alike; plans written before it did list none, and the
    exporters drop them anyway: the model's forks are not operators such a plan lacks."""
    from autopar.graph import load_model
    from autopar.lowering.lower import check_context

    model = RESNET50.parents[1] / "tests" / "data" / "torch_llama_dynamo.onnx"
    plan = autopar.plan(model, devices=8)
    data = plan.to_dict()
    data["ops"] = [op for op in data["ops"] if not op.get("domain")]
    graph = load_model(model, batch=plan.problem.graph.tensor(plan.problem.graph.inputs[0]).shape[0])
    assert any(op.domain for op in graph.ops)
    check_context(read_plan_file(data), graph, 8, action="be exported")  # no sentence: the same model
    data["ops"] = data["ops"][1:]
    with pytest.raises(PlanFileError, match="The plan has no strategy for operator"):
        check_context(read_plan_file(data), graph, 8, action="be exported")


GPT = Path(__file__).parent / "data" / "torch_gpt_dynamo.onnx"


def test_verify_runs_a_plan_file_as_it_was_made(tmp_path, capsys):
    """A plan file verifies on the devices it was made for, at its batch (one micro-batch's, where it has
    several, or the whole one given) and training all but what it lists as frozen, with no flag saying so
    again; a batch given that differs is said as a batch, not as another model."""
    made = tmp_path / "plan.json"
    argv = ["--devices", "4", "--micro-batches", "2", "--frozen", "blocks.0.*", "--format", "json", "-o", made]
    assert run(capsys, "plan", GPT, *argv)[0] == 0
    code, out, err = run(capsys, "verify", GPT, "--plan", made, "--gradients")
    assert (code, err) == (0, "") and out.startswith("autopar verify: VERIFIED on 4 virtual devices")
    report = autopar.verify(GPT, made, gradients=True)  # the same from Python, checking the trained alone
    data = json.loads(made.read_text())
    trained = {entry["parameter"] for entry in data["gradient_sync"]}
    assert data["frozen"] and all(name.startswith("blocks.0.") and name not in trained for name in data["frozen"])
    assert report.ok and report.gradients is not None and report.gradients.checked == len(trained)
    code, out, err = run(capsys, "verify", GPT, "--plan", made, "--batch", "4")  # the whole batch: the same
    assert (code, err) == (0, "") and out.startswith("autopar verify: VERIFIED on 4 virtual devices")
    code, out, err = run(capsys, "verify", GPT, "--plan", made, "--batch", "8")
    assert (code, out) == (1, "") and err == (
        "autopar: error: The plan was made for input 'ids' of shape [2, 16], not [8, 16] (a plan searched at one"
        " batch does not hold at another); its shapes are one of 2 micro-batches: leave --batch out, or give the"
        " whole 4.\n"
    )
    staged = tmp_path / "staged.json"  # a pipelined plan too: at its own batch, or the whole one given
    argv = ["--devices", "4", "--pipeline-stages", "2", "--micro-batches", "2", "--format", "json", "-o", staged]
    assert run(capsys, "plan", GPT, *argv)[0] == 0
    for batch in ([], ["--batch", "4"]):
        code, out, err = run(capsys, "verify", GPT, "--plan", staged, *batch)
        assert (code, err) == (0, "") and out.startswith("autopar verify: VERIFIED on 4 virtual devices")
