"""The typed plan file: a real plan round-trips; a broken file is refused in one sentence naming the field."""

from __future__ import annotations

import copy
import json

import onnx
import pytest

import autopar
from autopar.cli import main
from autopar.errors import PlanFileError
from autopar.lowering import SCHEMA, PlanFile, json_schema, load_plan_file, read_plan_file
from tests.conftest import two_matmul_chain

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
