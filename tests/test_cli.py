"""The `autopar` command line, run in-process (plus one real subprocess)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autopar.graph import load_model
from models.resnet50 import build_resnet50
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[1]
RESNET50 = REPO / "models" / "resnet50.onnx"
ASCEND910 = REPO / "costmodels" / "ascend910.toml"
TINY = dict(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1))

PLAN_KEYS = {
    "schema",
    "model",
    "devices",
    "cost_model",
    "ops",
    "redistributions",
    "gradient_sync",
    "fallback_ops",
    "totals",
    "search",
}
TOTALS_KEYS = {"step_time_s", "compute_s", "communication_s", "memory_per_device_bytes", "ideal_step_time_s"}
SEARCH_KEYS = {"algorithm", "time_s", "candidates"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.onnx"
    onnx.save(build_resnet50(**TINY), str(path))
    return path


@pytest.fixture(scope="module")
def tiny_ops(tiny_path) -> list:
    return load_model(tiny_path).ops


run = run_cli


def plan_json(capsys, *argv) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(err: str) -> None:
    assert err.startswith("autopar: error:"), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err


# --- plan output --------------------------------------------------------------------------------


def test_plan_table(capsys, tiny_path, tiny_ops):
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "4", "--all")
    assert code == 0, err
    # a batch of 4 and 8 channels: too little work to split, and stderr says so (the report's warning)
    assert err.startswith("autopar: warning: The model is fully replicated") and err.count("\n") == 1, err
    assert out.startswith("autopar plan: tiny on 4 devices")
    for label in ("step time", "vs data parallel", "memory/device"):
        assert re.search(rf"^{re.escape(label)}:", out, re.MULTILINE), label
    listed = {line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")}
    for op in tiny_ops:
        assert op.name in listed, op.name
    assert out.index("step time:") < out.index("operator ")  # the summary comes first
    # the totals agree with the JSON form of the same plan
    totals = plan_json(capsys, tiny_path, "--devices", "4")["totals"]
    step_line = next(line for line in out.splitlines() if line.startswith("step time:"))
    assert f"{totals['step_time_s'] * 1e3:.3f} ms" in step_line


def test_plan_table_lists_the_costliest_operators_unless_asked_for_all(capsys):
    code, out, err = run(capsys, "plan", "models/resnet50.onnx", "--devices", "8")
    assert code == 0, err
    assert len(out.splitlines()) <= 46
    assert "the 10 costliest of 186 operators" in out
    assert " BatchNormalization " in out  # type names in full
    costliest = out.split("costliest first (--all")[1].splitlines()[3:]
    totals = [float(line.split()[-2]) for line in costliest]  # the total ms column, before the "-" collectives
    assert totals == sorted(totals, reverse=True) and len(totals) == 10  # by real cost, descending
    code, out, _ = run(capsys, "plan", "models/resnet50.onnx", "--devices", "8", "--top", "5")
    assert "the 5 costliest" in out and len(out.splitlines()) <= 41
    code, out, _ = run(capsys, "plan", "models/resnet50.onnx", "--devices", "8", "--all")
    assert "all 186 operators" in out and len(out.splitlines()) > 186
    assert re.search(r"(AllGather|ReduceScatter|AllToAll|AllReduce) over \d+ devices \((HCCS|PCIe)", out)


def test_plan_json_schema(capsys, tiny_path, tiny_ops):
    data = plan_json(capsys, tiny_path, "--devices", "4")
    assert set(data) >= PLAN_KEYS
    assert data["schema"] == "autopar.plan/3"
    assert data["model"] == "tiny"
    assert data["devices"] == 4
    assert data["cost_model"] == "ascend910"
    assert set(data["totals"]) >= TOTALS_KEYS
    assert set(data["search"]) >= SEARCH_KEYS
    assert data["search"]["algorithm"] == "dp"
    assert data["search"]["candidates"] >= len(tiny_ops)
    assert [op["name"] for op in data["ops"]] == [op.name for op in tiny_ops]
    assert isinstance(data["redistributions"], list) and isinstance(data["gradient_sync"], list)
    assert data["fallback_ops"] == []
    totals = data["totals"]
    assert totals["step_time_s"] > 0 and totals["memory_per_device_bytes"] > 0
    parts = totals["compute_s"] + totals["communication_s"] + totals["optimizer_update_s"]
    assert parts == pytest.approx(totals["step_time_s"], rel=1e-9) and totals["optimizer_update_s"] > 0
    assert totals["ideal_step_time_s"] <= totals["step_time_s"]


def test_out_writes_file_and_nothing_to_stdout(capsys, tiny_path, tmp_path):
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "4", "--format", "json", "--out", target)
    assert code == 0, err
    assert out == ""
    data = json.loads(target.read_text(encoding="utf-8"))
    assert data["schema"] == "autopar.plan/3" and data["devices"] == 4


def test_out_table(capsys, tiny_path, tmp_path):
    target = tmp_path / "plan.txt"
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "2", "--out", target)
    assert code == 0, err
    assert out == ""
    assert "step time:" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("command", ["plan", "report"])
def test_out_nothing_could_be_written_to_is_refused_before_planning(capsys, tiny_path, tmp_path, monkeypatch, command):
    """A missing folder or a directory as ``--out`` is a bad flag: one sentence, exit 2, and no search runs."""
    import autopar.api

    monkeypatch.setattr(autopar.api, "plan_with", lambda *args: pytest.fail("planned"))
    for target, said in ((tmp_path / "no" / "such" / "dir.json", "does not exist"), (tmp_path, "is a directory")):
        code, out, err = run(capsys, command, tiny_path, "--devices", "1", "--out", target)
        assert code == 2 and out == ""
        assert_one_line_error(err)
        assert said in err


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expect", [("6", "power of two"), ("0", "power of two"), ("-4", "power of two"), ("abc", "integer")]
)
def test_bad_device_counts(capsys, tiny_path, value, expect):
    code, out, err = run(capsys, "plan", tiny_path, "--devices", value)
    assert code == 2
    assert out == ""
    assert_one_line_error(err)
    assert expect in err and value in err


def test_bad_model_path(capsys, tmp_path):
    missing = tmp_path / "missing.onnx"
    code, out, err = run(capsys, "plan", missing)
    assert code == 1
    assert out == ""
    assert_one_line_error(err)
    assert "missing.onnx" in err


def test_foreign_model_file(capsys, tmp_path):
    text = tmp_path / "readme.txt"
    text.write_text("hello\nworld\n", encoding="utf-8")
    code, out, err = run(capsys, "inspect", text)
    assert code == 1
    assert out == ""
    assert_one_line_error(err)


def test_unknown_cost_model(capsys, tiny_path):
    code, out, err = run(capsys, "plan", tiny_path, "--cost-model", "nosuch")
    assert code == 2  # a flag's value, as an unknown --search is
    assert out == ""
    assert_one_line_error(err)
    assert "nosuch" in err and "ascend910" in err  # names the bad one and what is bundled


def test_cost_model_file_copy_works(capsys, tiny_path, tmp_path):
    copy = tmp_path / "copy.toml"
    copy.write_text(ASCEND910.read_text(encoding="utf-8"), encoding="utf-8")
    bundled = plan_json(capsys, tiny_path, "--devices", "4")
    from_file = plan_json(capsys, tiny_path, "--devices", "4", "--cost-model", copy)
    assert from_file["totals"] == bundled["totals"]


def test_cost_model_missing_source(capsys, tiny_path, tmp_path):
    # a number without its source is used as given, and named in one warning line
    text = ASCEND910.read_text(encoding="utf-8")
    unsourced_text, removed = re.subn(r',\s*source\s*=\s*"[^"]*"', "", text, count=1)
    assert removed == 1
    unsourced = tmp_path / "unsourced.toml"
    unsourced.write_text(unsourced_text, encoding="utf-8")
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "1", "--cost-model", unsourced)
    assert code == 0 and out
    assert err.startswith("autopar: warning:") and err.count("\n") == 1, err
    assert "compute.peak_flops_fp16 has no source" in err


def test_unknown_subcommand(capsys):
    code, out, err = run(capsys, "frobnicate", RESNET50)
    assert code == 2
    assert out == ""
    assert_one_line_error(err)
    assert "frobnicate" in err


def test_unknown_flag(capsys, tiny_path):
    code, out, err = run(capsys, "plan", tiny_path, "--no-such-flag")
    assert code == 2
    assert out == ""
    assert_one_line_error(err)
    assert "--no-such-flag" in err


def test_no_arguments(capsys):
    code, _out, err = run(capsys)
    assert code == 2
    assert_one_line_error(err)


def test_unbound_symbolic_dim_and_dim_flag(capsys, tmp_path):
    w = numpy_helper.from_array(np.ones((16, 32), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "sym",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "sym.onnx"
    onnx.save(model, str(path))
    code, _out, err = run(capsys, "plan", path, "--devices", "2")
    assert code == 1
    assert_one_line_error(err)
    assert "--dim N=" in err
    data = plan_json(capsys, path, "--devices", "2", "--dim", "N=8")
    assert [op["name"] for op in data["ops"]] == ["mm"]
    code, _out, err = run(capsys, "plan", path, "--dim", "N")
    assert code == 2
    assert_one_line_error(err)


# --- modes and precision ------------------------------------------------------------------------


def test_data_parallel_mode_splits_only_the_batch(capsys, tiny_path):
    data = plan_json(capsys, tiny_path, "--devices", "4", "--mode", "data_parallel")
    assert data["mode"] == "data_parallel"
    convs = [op for op in data["ops"] if op["op_type"] == "Conv"]
    assert len(convs) == 17
    for op in convs:
        activation, weight = op["strategy"]
        assert activation == [4, 1, 1, 1], op["name"]
        assert weight == [1, 1, 1, 1], op["name"]
    # data parallel is what the "vs data parallel" line compares with
    assert data["totals"]["step_time_s"] == pytest.approx(data["totals"]["data_parallel_step_time_s"], rel=1e-12)


def test_stand_alone_mode_is_all_ones(capsys, tiny_path):
    data = plan_json(capsys, tiny_path, "--devices", "4", "--mode", "stand_alone")
    assert data["mode"] == "stand_alone"
    for op in data["ops"]:
        assert all(f == 1 for entry in op["strategy"] for f in entry), op
    assert data["redistributions"] == []
    assert all(g["collective"] is None for g in data["gradient_sync"])


def test_fp32_is_slower_than_mixed(capsys, tiny_path):
    mixed = plan_json(capsys, tiny_path, "--devices", "4")
    fp32 = plan_json(capsys, tiny_path, "--devices", "4", "--precision", "fp32")
    assert mixed["precision"] == "mixed" and fp32["precision"] == "fp32"
    assert fp32["totals"]["step_time_s"] > mixed["totals"]["step_time_s"]
    assert fp32["totals"]["memory_per_device_bytes"] > mixed["totals"]["memory_per_device_bytes"]


def test_unknown_precision_is_a_usage_error(capsys, tiny_path):
    code, _out, err = run(capsys, "plan", tiny_path, "--precision", "fp8")
    assert code == 2
    assert_one_line_error(err)


# --- inspect ------------------------------------------------------------------------------------


def test_inspect_table(capsys, tiny_path, tiny_ops):
    code, out, err = run(capsys, "inspect", tiny_path)
    assert code == 0, err
    counts = {}
    for op in tiny_ops:
        counts[op.op_type] = counts.get(op.op_type, 0) + 1
    for op_type, count in counts.items():
        assert re.search(rf"^{op_type}\s+{count}\s", out, re.MULTILINE), op_type
    assert counts["Conv"] == 17
    graph = load_model(tiny_path)
    trainable = sum(p.numel for p in graph.parameters if p.trainable)
    assert f"({trainable:,} trainable)" in out
    assert f"{len(tiny_ops)} operators" in out


def test_inspect_json(capsys, tiny_path, tiny_ops):
    code, out, err = run(capsys, "inspect", tiny_path, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["operators"] == len(tiny_ops)
    assert sum(entry["count"] for entry in data["ops_by_type"].values()) == len(tiny_ops)
    assert data["ops_by_type"]["Conv"]["count"] == 17
    assert data["inputs"] == {"images": [4, 3, 32, 32], "labels": [4]}
    assert data["outputs"] == {"loss": [], "logits": [4, 10]}
    graph = load_model(tiny_path)
    assert data["parameters"]["trainable_elements"] == sum(p.numel for p in graph.parameters if p.trainable)
    assert data["forward_flops"] == pytest.approx(graph.total_flops)


def test_inspect_batch_flag(capsys, tiny_path):
    code, out, err = run(capsys, "inspect", tiny_path, "--batch", "8", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["outputs"]["logits"] == [8, 10]
    code, out, err = run(capsys, "inspect", tiny_path, "--batch", "0")
    assert code == 2
    assert_one_line_error(err)


# --- determinism and the real entry point -------------------------------------------------------


def test_plan_json_is_deterministic(capsys, tiny_path):
    runs = []
    for _ in range(2):
        data = plan_json(capsys, tiny_path, "--devices", "8")
        assert isinstance(data["search"].pop("time_s"), float)
        assert set(data["search"].pop("phases_s")) == {"import", "costing", "search", "lowering"}
        runs.append(json.dumps(data, sort_keys=True))
    assert runs[0] == runs[1]


def test_module_entry_point_subprocess():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("AUTOPAR_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "plan", "models/resnet50.onnx", "--devices", "8", "--format", "json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema"] == "autopar.plan/3"
    assert data["model"] == "resnet50"
    assert data["devices"] == 8
    assert len(data["ops"]) == 186
    totals = data["totals"]
    assert 0 < totals["step_time_s"] <= totals["data_parallel_step_time_s"]
    assert math.isfinite(totals["memory_per_device_bytes"])
    assert totals["memory_per_device_bytes"] <= totals["memory_capacity_bytes"]


# --- stdout carries the output alone ------------------------------------------------------------

# every command that takes --format json, with the arguments that make it run on a small model
JSON_COMMANDS = {
    "plan": ["plan", "{model}", "--devices", "4"],
    "plan --search ilp": ["plan", "{model}", "--devices", "4", "--search", "ilp"],
    "plan semi-auto": ["plan", "{model}", "--devices", "4", "--fix", "conv1=((4,1,1,1),(1,1,1,1))"],
    "verify": ["verify", "{model}", "--devices", "4"],
    "sweep": ["sweep", "{model}", "--devices", "1,4,65536"],
    "inspect": ["inspect", "{model}"],
}


def _commands_taking_format_json() -> set[str]:
    from autopar.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return {
        name
        for name, sub in commands.choices.items()
        if any("--format" in a.option_strings and "json" in (a.choices or ()) for a in sub._actions)
    }


def test_every_json_command_is_checked():
    assert {argv[0] for argv in JSON_COMMANDS.values()} == _commands_taking_format_json()


@pytest.mark.parametrize("case", sorted(JSON_COMMANDS))
def test_format_json_writes_only_json_on_stdout(case, tiny_path):
    # a real process, so that what a compiled library writes to descriptor 1 (HiGHS' banner) is seen too
    if "ilp" in case:
        pytest.importorskip("highspy")
    argv = [part.format(model=tiny_path) for part in JSON_COMMANDS[case]]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("AUTOPAR_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "autopar", *argv, "--format", "json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # the whole of stdout, nothing before or after
    assert "HiGHS" not in proc.stderr + proc.stdout


def test_a_library_writing_to_descriptor_1_reaches_stderr_not_stdout(capfd):
    from autopar.stdio import stdout_elsewhere

    print("before", flush=True)
    with stdout_elsewhere(True):
        os.write(1, b"from C\n")
        print("from Python")
    with stdout_elsewhere():
        os.write(1, b"dropped\n")
        print("dropped too")
    print("after")
    out, err = capfd.readouterr()
    assert out == "before\nafter\n"
    assert err == "from C\nfrom Python\n"


# --- the report's warnings on the terminal ------------------------------------------------------


def _warned(err: str, prefix: str = "") -> list[str]:
    return [line.removeprefix(f"autopar: warning: {prefix}") for line in err.splitlines() if line.startswith("autopar")]


def test_plan_and_report_say_the_reports_warnings_on_stderr(capsys, tiny_path, tmp_path):
    from autopar.report.html import warnings_of

    # a batch of 4 on 64 devices: too little work to split, every device runs the whole model
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "64", "--format", "json")
    assert code == 0, err
    expected = warnings_of(json.loads(out))
    assert expected and expected[0].startswith("The model is fully replicated")
    assert _warned(err) == expected
    code, out, table_err = run(capsys, "plan", tiny_path, "--devices", "64")
    assert code == 0 and table_err == err
    page = tmp_path / "tiny.html"
    code, _, err = run(capsys, "report", tiny_path, "--devices", "64", "-o", page)
    assert code == 0, err
    assert _warned(err)[: len(expected)] == expected
    html = page.read_text(encoding="utf-8")
    assert all(f"<li>{sentence.replace(chr(39), '&#x27;')}</li>" in html for sentence in expected)
    # and a plan without any says nothing
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--format", "json")
    assert code == 0 and err == ""


def test_resnet50_at_512_devices_warns_of_repeated_work(capsys):
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "512", "--format", "json")
    assert code == 0
    assert _warned(err) == [
        "Idle devices: the largest split uses 256 of 512 devices; the other 1 of every 2 repeat the same calculation."
    ]


def test_sweep_says_each_counts_warnings_on_stderr(capsys, tiny_path):
    code, out, err = run(capsys, "sweep", tiny_path, "--devices", "1,4,64", "--format", "json")
    assert code == 0, err
    points = json.loads(out)
    assert points[0]["warnings"] == []  # one device repeats nothing
    assert points[2]["warnings"][0].startswith("The model is fully replicated")
    said = [f"{p['devices']} devices: {sentence}" for p in points for sentence in p["warnings"]]
    assert _warned(err) == said


# --- flags that agree ---------------------------------------------------------------------------


def test_plan_takes_o_as_every_command_does(capsys, tiny_path, tmp_path):
    short, long = tmp_path / "short.json", tmp_path / "long.json"
    for flag, target in (("-o", short), ("--out", long)):
        code, out, err = run(capsys, "plan", tiny_path, "--devices", "1", "--format", "json", flag, target)
        assert code == 0 and out == "", err
    assert json.loads(short.read_text())["totals"] == json.loads(long.read_text())["totals"]


def test_plan_and_report_share_the_flags_that_choose_a_plan():
    from autopar.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    choosing = {"--mode", "--fix", "--strategies", "--search", "--frozen", "--micro-batches", "--no-overlap"}
    choosing |= {"--devices", "--rank-table", "--cost-model", "--precision", "--batch", "--dim"}

    def flags(command: str) -> dict:
        return {
            option: (a.dest, a.default, a.choices, a.help, a.type)
            for a in commands[command]._actions
            for option in a.option_strings
        }

    plan, report = flags("plan"), flags("report")
    assert {flag: plan[flag] for flag in choosing} == {flag: report[flag] for flag in choosing}
    for command in ("plan", "verify", "sweep", "report", "inspect"):
        for action in commands[command]._actions:
            assert action.help, (command, action.option_strings or action.dest)


def test_report_reports_a_semi_auto_plan_and_a_plan_file(capsys, tiny_path, tmp_path):
    fixed = "conv1=((2,1,1,1),(2,1,1,1))"
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "4", "--mode", "semi_auto_parallel", "--fix", fixed,
                         "--no-overlap", "--format", "json")  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    page = tmp_path / "semi.html"
    code, _, err = run(capsys, "report", tiny_path, "--devices", "4", "--mode", "semi_auto_parallel", "--fix", fixed,
                       "--no-overlap", "-o", page)  # fmt: skip
    assert code == 0, err
    html = page.read_text(encoding="utf-8")
    assert "semi_auto_parallel" in html and "cost of the fixed strategies" in html
    assert f"data-value='{plan['totals']['step_time_s']!r}'" in html  # the very plan `plan` found

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(out, encoding="utf-8")
    code, _, err = run(capsys, "report", tiny_path, "--plan", plan_path, "-o", tmp_path / "file.html")
    assert code == 0, err
    assert f"data-value='{plan['totals']['step_time_s']!r}'" in (tmp_path / "file.html").read_text(encoding="utf-8")
    code, out, err = run(capsys, "report", tiny_path, "--plan", plan_path, "--mode", "data_parallel")
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert "--plan reports the plan file as it was made, so it takes no --mode." in err
    code, out, err = run(capsys, "report", RESNET50, "--plan", plan_path, "-o", tmp_path / "other.html")
    assert code == 1 and out == ""
    assert_one_line_error(err)
    assert "made for another model" in err and not (tmp_path / "other.html").exists()


@pytest.mark.parametrize("name", ["A100", "Ascend910", "H100"])
def test_cost_model_names_in_any_case(capsys, tiny_path, name):
    data = plan_json(capsys, tiny_path, "--devices", "1", "--cost-model", name)
    assert data["cost_model"] == name.lower()


def test_devices_error_names_the_flag_once(capsys, tiny_path):
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "6")
    assert code == 2 and out == ""
    assert err == (
        "autopar: error: --devices must be a power of two from 1 to 65,536 (1, 2, 4, 8, ...), got 6"
        " (see 'autopar plan --help').\n"
    )


def test_a_directory_as_the_model_says_so(capsys, tmp_path):
    for command in ("plan", "inspect", "verify", "report", "sweep"):
        code, out, err = run(capsys, command, tmp_path)
        assert code == 1 and out == ""
        assert_one_line_error(err)
        assert f"'{tmp_path}' is a directory; give the ONNX model file in it." in err


def test_dim_batch_points_to_the_batch_flag(capsys, tiny_path):
    code, out, err = run(capsys, "plan", tiny_path, "--dim", "batch=8")
    assert code == 1 and out == ""
    assert_one_line_error(err)
    assert err.rstrip().endswith("set the batch, the inputs' leading dimension, with --batch 8.")


@pytest.mark.parametrize("name", ["N\r", "N\n", "N\x1b[2J"])
def test_a_flag_holding_a_control_character_is_one_escaped_line(capsys, tiny_path, name):
    code, out, err = run(capsys, "plan", tiny_path, "--dim", f"{name}=x")
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert repr(name)[1:-1] in err and "must be an integer, got 'x'" in err


def test_export_names_files_in_one_style(capsys, tiny_path, tmp_path, monkeypatch):
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "2", "--format", "json")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(out, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    written = []
    for to in ("mindspore", "onnx", "dtensor", "jax"):
        code, _, err = run(capsys, "export", plan_path, "--to", to, "--model", tiny_path)
        assert code == 0, err
        written += [line.removeprefix("autopar: wrote ") for line in err.splitlines() if "wrote" in line]
    assert sorted(written) == sorted(
        ["tiny_strategy.ckpt", "tiny_strategy.py", "tiny_sharded.onnx", "tiny_dtensor.py", "tiny_jax.py"]
    )


def test_bench_scripts_run_as_the_readme_writes_them():
    # `python bench/transformers.py` as written: not as a module, not with the repository on PYTHONPATH
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for script in sorted((REPO / "bench").glob("*.py")):
        if script.name == "__init__.py":
            continue
        proc = subprocess.run(
            [sys.executable, str(script), "--help"],
            cwd=REPO.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (script.name, proc.stderr[-500:])
        assert proc.stdout.startswith("usage:"), script.name
    proc = subprocess.run(
        [sys.executable, "bench/transformers.py", "--presets", "gpt2", "--devices", "8", "--layers", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-500:]
    assert "layer0.mlp.fc1" in proc.stdout


def test_the_default_table_leads_with_what_the_search_decided(capsys):
    code, out, err = run(capsys, "plan", "models/resnet50.onnx", "--devices", "8")
    assert code == 0, err
    summary = out.split("\n\n")[1]
    for label, expect in [
        ("degrees", "data 8 x tensor 1 (8 devices)"),
        ("global batch", "256 samples a step"),
        ("throughput", "samples/s"),
        ("MFU", "%"),
    ]:
        line = next(line for line in summary.splitlines() if line.startswith(f"{label}:"))
        assert expect in line, line
    # the operators off data parallel, then every redistributed tensor, then the costliest
    decisions, redistributed, costliest = (
        out.index("decisions:"),
        out.index("redistributed tensors:"),
        out.index("costliest of"),
    )
    assert decisions < redistributed < costliest
    assert re.search(r"^fc +Gemm +\(\(4,1\),\(2,1\),\(2,\)\) +batch 4 x channels/hidden 2 ", out, re.MULTILINE)
    moved = out[redistributed:].split("\n\n")[0].splitlines()
    assert moved[0].startswith("redistributed tensors: 4,") and len(moved) == 3 + 4  # title, header, rule, rows
    assert {line.split()[0] for line in moved[3:]} == {"loss.neg", "flatten", "logits", "loss.reduce_max"}
    # "x" multiplies split factors only: a speed-up is a plain ratio, copies a count
    assert re.search(r"speed-up \d+\.\d{3}\n", out) and not re.search(r"x\d", out)


def test_repeated_blocks_fold_into_one_decision_row(capsys, tmp_path):
    from models.transformer import build_transformer

    path = tmp_path / "gpt.onnx"
    onnx.save(build_transformer(kind="gpt", layers=6, hidden=1024, heads=16, seq=512, vocab=8192, batch=8), str(path))
    code, out, err = run(capsys, "plan", str(path), "--devices", "8", "--quiet")
    assert code == 0, err
    rows = out.split("decisions:")[1].split("\n\n")[0].splitlines()
    assert any(" (6 copies) " in row for row in rows)
    assert not any(row.startswith(("layer1.", "layer5.")) for row in rows)  # later copies fold into layer0's rows


def test_a_size_computed_from_data_is_bound_with_the_key_the_error_names(capsys, tmp_path):
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
        helper.make_node("Cast", ["nz"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Relu", ["f"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "data_sized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "data_sized.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    code, _out, err = run(capsys, "plan", path, "--devices", "2")
    assert code == 1
    assert_one_line_error(err)
    assert "--dim nz:1=VALUE" in err and "unk__" not in err
    data = plan_json(capsys, path, "--devices", "2", "--dim", "nz:1=5")
    assert [op["name"] for op in data["ops"]] == ["nonzero", "Cast_1", "relu"]


def test_trainable_flag_trains_a_constant_the_import_took_for_a_mask(capsys, tmp_path):
    from tests.test_graph import _masked_scores

    path = tmp_path / "masked.onnx"
    onnx.save(_masked_scores("Where"), str(path))
    synced = [entry["parameter"] for entry in plan_json(capsys, path, "--devices", "2")["gradient_sync"]]
    assert synced == ["w"]
    data = plan_json(capsys, path, "--devices", "2", "--trainable", "mask")
    assert [entry["parameter"] for entry in data["gradient_sync"]] == ["w", "mask"]
    code, _out, err = run(capsys, "plan", path, "--devices", "2", "--trainable", "nothing")
    assert code == 1
    assert_one_line_error(err)
