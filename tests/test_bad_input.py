"""Every bad input the fuzz run of the bad-input issue found: one sentence and exit 1 (input) or 2 (flag).

Each case names its command and the sentence it now gets; none is an internal error (exit 3).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autopar.cli import main
from autopar.limits import MAX_DIMENSION
from models.transformer import build_preset
from tests.conftest import simple_profile_dict

REPO = Path(__file__).resolve().parents[1]
RESNET50 = str(REPO / "models" / "resnet50.onnx")
GPT = str(REPO / "tests" / "data" / "torch_gpt_legacy.onnx")
FLOAT = TensorProto.FLOAT


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's exits
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error:"), err
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


def save(tmp_path, nodes, inputs, outputs, inits=(), opset=17, name="m.onnx") -> Path:
    graph = helper.make_graph(nodes, "m", inputs, outputs, initializer=list(inits))
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), path)
    return path


def x_input(shape, elem_type=FLOAT):
    return helper.make_tensor_value_info("x", elem_type, shape)


Y = helper.make_tensor_value_info("y", FLOAT, None)
W = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
MATMUL = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")


@pytest.mark.parametrize(
    "shape, weight, expect",
    [([-5, 4], W, "size -5 on axis 0"), ([4, 4], numpy_helper.from_array(np.ones((4, 0), np.float32), "W"), "size 0")],
)
def test_non_positive_sizes_are_refused(capsys, tmp_path, shape, weight, expect):
    path = save(tmp_path, [MATMUL], [x_input(shape)], [Y], [weight])
    code, out, err = run(capsys, "plan", path, "--devices", "4")
    assert code == 1 and out == ""
    assert expect in one_sentence(err)


def test_models_the_checker_or_autopar_rejects(capsys, tmp_path):
    z = helper.make_tensor_value_info("z", FLOAT, None)
    relu_foo = helper.make_node("Relu", ["x"], ["y"], name="r", foo=3)
    gemm_list = helper.make_node("Gemm", ["x", "W"], ["y"], name="g", transB=[1, 2])
    int_w = numpy_helper.from_array(np.ones((4, 4), np.int32), "W")
    string_id = helper.make_node("Identity", ["x"], ["y"], name="i")
    cases = {
        "opset 99": (save(tmp_path, [MATMUL], [x_input([4, 4])], [Y], [W], opset=99, name="a.onnx"), "opset 99"),
        "dangling output": (save(tmp_path, [MATMUL], [x_input([4, 4])], [Y, z], [W], name="b.onnx"), "'z'"),
        "output is an input": (
            save(tmp_path, [MATMUL, helper.make_node("Relu", ["y"], ["x"], name="r")], [x_input([4, 4])], [Y], [W],
                 name="c.onnx"),
            "single static assignment",
        ),
        "string input": (
            save(tmp_path, [string_id], [x_input([4, 4], TensorProto.STRING)],
                 [helper.make_tensor_value_info("y", TensorProto.STRING, None)], name="d.onnx"),
            "STRING",
        ),
        "unknown attribute": (save(tmp_path, [relu_foo], [x_input([4, 4])], [Y], name="e.onnx"), "foo"),
        "attribute of the wrong type": (save(tmp_path, [gemm_list], [x_input([4, 4])], [Y], [W], name="f.onnx"),
                                        "transB"),
        "initializer of the wrong dtype": (save(tmp_path, [MATMUL], [x_input([4, 4])], [Y], [int_w], name="g.onnx"),
                                           "int32"),
    }  # fmt: skip
    for label, (path, expect) in cases.items():
        code, _out, err = run(capsys, "plan", path, "--devices", "4")
        assert code == 1, label
        assert expect in one_sentence(err), (label, err)


def test_undefined_input_type_is_one_sentence(capsys, tmp_path):
    path = save(tmp_path, [MATMUL], [x_input([4, 4])], [Y], [W])
    model = onnx.load(path)
    model.graph.input[0].type.tensor_type.elem_type = 0
    onnx.save(model, path)
    code, _, err = run(capsys, "plan", path, "--devices", "4")
    assert code == 1
    one_sentence(err)


def test_duplicate_names_plan_with_a_warning(capsys, tmp_path):
    relu = helper.make_node("Relu", ["y"], ["z"], name="mm")
    path = save(tmp_path, [MATMUL, relu], [x_input([4, 4])], [helper.make_tensor_value_info("z", FLOAT, None)], [W])
    code, out, err = run(capsys, "plan", path, "--devices", "4", "--format", "json")
    assert code == 0
    assert [op["name"] for op in json.loads(out)["ops"]] == ["mm", "mm_1"]
    assert err.startswith("autopar: warning:") and "'mm_1'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["plan", RESNET50, "--batch", "1099511627776"], "--batch must be from 1 to 16,777,216"),
        (["plan", RESNET50, "--batch", str(2**63)], "--batch must be from 1"),
        (["plan", GPT, "--dim", f"N={2**63}"], "--dim N must be from 1"),
        (["plan", RESNET50, "--devices", "131072"], "power of two from 1 to 65,536"),
        (["verify", RESNET50, "--seed", "-1"], "--seed must be from 0"),
    ],
)
def test_flags_out_of_range_are_usage_errors(capsys, argv, expect):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert expect in one_sentence(err)


def test_the_limit_on_sizes_is_the_one_stated():
    assert MAX_DIMENSION == 16_777_216


def test_too_many_devices_for_the_model_is_refused_at_once(capsys, tmp_path):
    # one GPT-3-shaped layer on 65,536 devices would need 243 million table entries: refused before costing
    path = tmp_path / "gpt3_layer.onnx"
    onnx.save(build_preset("gpt3", layers=1, batch=64), path)
    code, _out, err = run(capsys, "plan", str(path), "--devices", "65536")
    assert code == 1
    assert "use fewer devices" in one_sentence(err)


@pytest.mark.parametrize(
    "where, value, expect",
    [
        (("compute", "hbm_capacity"), "inf", "finite"),
        (("links", 0, "latency"), "inf", "finite"),
        (("links", 0, "bandwidth"), "inf", "finite"),
        (("links", 0, "bandwidth"), 1e-300, "links[0].bandwidth must be above 1 and at most 1e+18"),
        (("compute", "cube_efficiency"), 1.5, "compute.cube_efficiency must be above 0 and at most 1"),
        (
            ("training", "gradient_fusion_bytes"),
            1e308,
            "training.gradient_fusion_bytes must be above 0 and at most 1e+18",
        ),
        (("compute", "memory_reserve"), 1e308, "compute.memory_reserve must be from 0 to 1e+18"),
        (("compute", "memory_reserve"), 2e12, "memory_reserve (2e+12 B) must be below hbm_capacity (1e+12 B)"),
        (("links", 0, "bits"), 100, "links[0].bits must be a whole number from 1 to 64"),
    ],
)
def test_cost_models_that_make_no_sense_are_refused(capsys, tmp_path, where, value, expect):
    data = simple_profile_dict()
    table = data
    for key in where[:-1]:
        table = table[key]
    table[where[-1]] = value if where[-1] == "bits" else {"value": value, "source": "test"}
    lines = []
    for section in ("compute", "training"):
        lines.append(f"[{section}]")
        for key, entry in data[section].items():
            fields = ", ".join(
                f"{name} = {'inf' if value == 'inf' else json.dumps(value)}" for name, value in entry.items()
            )
            lines.append(f"{key} = {{ {fields} }}")
    for level in data["links"]:
        lines.append("[[links]]")
        lines.append(f'name = "{level["name"]}"\nbits = {level["bits"]}')
        for key in ("bandwidth", "latency"):
            lines.append(f'{key} = {{ value = {level[key]["value"]}, source = "{level[key]["source"]}" }}')
    profile = tmp_path / "bad.toml"
    profile.write_text('name = "bad"\n' + "\n".join(lines) + "\n")
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--cost-model", profile)
    assert code == 1
    assert expect in one_sentence(err), err


def test_a_tiny_capacity_is_said_in_bytes(capsys, tmp_path):
    text = (REPO / "costmodels" / "ascend910.toml").read_text()
    text = text.replace("hbm_capacity = { value = 32e9", "hbm_capacity = { value = 1")
    text = text.replace("memory_reserve = { value = 3.2e9", "memory_reserve = { value = 0")
    profile = tmp_path / "tiny.toml"
    profile.write_text(text)
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--cost-model", profile)
    assert code == 1
    assert "but the device has 1 B" in one_sentence(err)


def test_a_batch_too_big_for_activations_says_so(capsys):
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--batch", "65536", "--micro-batches", "1")
    assert code == 1
    sentence = one_sentence(err)
    assert "activations and inputs that do not fit" in sentence and "at least 1 devices" not in sentence


def test_a_batch_too_big_for_activations_is_accumulated_in_micro_batches(capsys):
    code, out, _ = run(capsys, "plan", RESNET50, "--devices", "8", "--batch", "65536", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    k = plan["memory_plan"]["micro_batches"]
    assert k > 1 and 65536 % k == 0
    assert plan["ops"][0]["inputs"][0]["tensor"] == "images"
    assert plan["totals"]["memory_per_device_bytes"] <= plan["totals"]["memory_capacity_bytes"]


def test_a_micro_batch_count_that_does_not_divide_the_batch_is_one_sentence(capsys):
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--micro-batches", "3")
    assert code == 1
    assert "does not split into 3 equal micro-batches" in one_sentence(err)


def test_a_plan_file_with_ops_only_names_the_missing_schema(capsys, tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text('{"ops": 5}')
    code, _, err = run(capsys, "verify", RESNET50, "--devices", "8", "--plan", plan)
    assert code == 1
    sentence = one_sentence(err)
    assert "schema" in sentence and "Strategies name operators" not in sentence


def test_out_is_written_whole_or_not_at_all(capsys, tmp_path):
    target = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", RESNET50, "--devices", "8", "--format", "json", "--out", target)
    assert code == 0 and json.loads(target.read_text())["devices"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left beside it
    code, _, err = run(capsys, "plan", RESNET50, "--devices", "8", "--out", tmp_path)
    assert code == 2 and "is a directory" in one_sentence(err)  # a bad flag, said before any planning


def test_a_verification_too_big_for_the_machine_is_refused_before_drawing_values(capsys):
    code, _, err = run(capsys, "verify", RESNET50, "--devices", "8")  # batch 256: about 39 GB
    assert code == 1
    assert "smaller batch" in one_sentence(err)


def test_an_output_inference_cannot_follow_is_named(capsys, tmp_path):
    fused = helper.make_node("FusedMatMul", ["x", "W"], ["y"], name="f", domain="com.microsoft")
    graph = helper.make_graph([fused], "m", [x_input([4, 4])], [helper.make_tensor_value_info("y", FLOAT, [4, 4])], [W])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    path = tmp_path / "custom.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), path)
    code, _, err = run(capsys, "plan", path, "--devices", "4")
    assert code == 1
    said = one_sentence(err)  # the operator inference stopped at, not a dimension to bind
    assert "stops at FusedMatMul 'f', which ONNX does not define in domain 'com.microsoft'" in said
    assert "--dim" not in said


# --- valid input the checks must not refuse ------------------------------------------------------


def test_empty_constants_and_a_reshape_to_a_scalar_still_plan_and_verify(capsys, tmp_path):
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=1),
        helper.make_node("Constant", [], ["e"], name="empty", value=numpy_helper.from_array(np.zeros(0, np.int64))),
        helper.make_node("Reshape", ["s", "e"], ["y"], name="scalar"),
    ]
    path = save(tmp_path, nodes, [x_input([4, 4])], [Y])
    code, _out, err = run(capsys, "plan", path, "--devices", "4", "--format", "json")
    assert code == 0, err
    pytest.importorskip("onnxruntime")
    code, _, err = run(capsys, "verify", path, "--devices", "4")
    assert code == 0, err


def test_an_absent_optional_input_verifies(capsys, tmp_path):
    conv = helper.make_node("Conv", ["x", "K", ""], ["y"], name="conv", kernel_shape=[1, 1])
    kernel = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "K")
    path = save(tmp_path, [conv], [x_input([2, 4, 3, 3])], [Y], [kernel])
    pytest.importorskip("onnxruntime")
    code, _, err = run(capsys, "verify", path, "--devices", "4")
    assert code == 0, err


def test_large_activations_and_a_placeholder_batch_are_not_input_limits(capsys, tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "flat"], ["f"], name="flatten"),
        helper.make_node("ReduceSum", ["f"], ["y"], name="sum", keepdims=0),
    ]
    flat = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    path = save(tmp_path, nodes, [x_input([-1, 3, 224, 224])], [Y], [flat])  # -1: a converter's placeholder batch
    code, _, err = run(capsys, "plan", path, "--devices", "4", "--batch", "128")  # 19,267,584 elements flattened
    assert code == 0, err


def test_out_writes_through_a_symlink(capsys, tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "real" / "plan.json")
    code, _, _ = run(capsys, "plan", RESNET50, "--devices", "8", "--format", "json", "--out", link)
    assert code == 0 and link.is_symlink()
    assert json.loads((tmp_path / "real" / "plan.json").read_text())["devices"] == 8


def test_strategies_for_an_operator_named_like_a_plan_field_are_strategies():
    import autopar

    pytest.importorskip("onnxruntime")
    node = helper.make_node("Relu", ["x"], ["y"], name="model")
    graph = helper.make_graph([node], "m", [x_input([4, 4])], [helper.make_tensor_value_info("y", FLOAT, [4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert autopar.verify(model, {"model": ((4, 1),)}, devices=4).ok


def test_a_search_whose_tables_pass_the_limits_answers_with_its_gap(capsys):
    # ResNet-50 on 65,536 devices, refused for its tables once: a plan, a lower bound and the gap
    code, out, _err = run(
        capsys, "plan", str(REPO / "models" / "resnet50.onnx"), "--devices", "65536", "--format", "json"
    )
    search = json.loads(out)["search"]
    assert code == 0 and search["exact"] is False and search["steps_split"] > 0
    assert 0 <= search["gap"] < 0.01


def _declared_model(tmp_path, edit) -> Path:
    """ResNet-50's first operators with the types inference gives them declared in the file, then ``edit``ed."""
    from onnx import shape_inference

    from models.resnet50 import build_resnet50

    model = shape_inference.infer_shapes(
        build_resnet50(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1))
    )
    edit({vi.name: vi for vi in [*model.graph.value_info, *model.graph.input]}, model)
    path = tmp_path / "declared.onnx"
    onnx.save(model, path)
    return path


def _swap(first: str, second: str):
    def edit(infos, _model) -> None:
        a, b = infos[first].type.tensor_type, infos[second].type.tensor_type
        a.elem_type, b.elem_type = b.elem_type, a.elem_type

    return edit


def test_declarations_whose_element_types_were_swapped_are_refused(capsys, tmp_path):
    # the file as written plans: its declarations agree with what each operator yields
    code, _, err = run(capsys, "plan", _declared_model(tmp_path, lambda infos, model: None), "--devices", "1")
    assert code == 0, err

    # an activation and a label column swap their declared types: float16 and int64 where float is yielded
    def as_float16(infos, model):
        infos["relu1"].type.tensor_type.elem_type = TensorProto.FLOAT16

    cases = [
        (_swap("labels", "conv1"), "Tensor 'conv1' is declared int64 but operator 'conv1' (Conv) yields float."),
        (as_float16, "Tensor 'relu1' is declared float16 but operator 'relu1' (Relu) yields float."),
    ]
    for edit, sentence in cases:
        path = _declared_model(tmp_path, edit)
        for argv in (["plan", path, "--devices", "1"], ["inspect", path], ["verify", path, "--devices", "1"]):
            code, out, err = run(capsys, *argv)
            assert code == 1 and out == "", (argv, err)
            assert one_sentence(err) == f"autopar: error: {sentence}"


def test_an_initializer_declared_with_another_type_is_refused(capsys, tmp_path):
    weight = helper.make_tensor_value_info("W", TensorProto.FLOAT16, [4, 4])
    path = save(tmp_path, [MATMUL], [x_input([4, 4])], [Y], [W])
    model = onnx.load(path)
    model.graph.value_info.append(weight)
    onnx.save(model, path)
    code, out, err = run(capsys, "plan", path, "--devices", "2")
    assert code == 1 and out == ""
    assert one_sentence(err) == "autopar: error: Initializer 'W' holds float but the model declares it float16."


def test_a_plan_file_listing_an_operator_twice_is_refused(capsys, tmp_path):
    path = save(tmp_path, [MATMUL, helper.make_node("Relu", ["y"], ["z"], name="relu")], [x_input([4, 4])],
                [helper.make_tensor_value_info("z", FLOAT, None)], [W])  # fmt: skip
    code, out, err = run(capsys, "plan", path, "--devices", "2", "--format", "json")
    assert code == 0, err
    plan = json.loads(out)
    twice = dict(plan, ops=[plan["ops"][0], plan["ops"][0], plan["ops"][1]])
    renamed = dict(plan, ops=[plan["ops"][0], dict(plan["ops"][1], name="mm")])
    for i, data in enumerate((twice, renamed)):
        plan_path = tmp_path / f"twice{i}.json"
        plan_path.write_text(json.dumps(data), encoding="utf-8")
        expected = (
            f"autopar: error: Plan file '{plan_path}' is not a valid autopar plan: ops: operator 'mm' is listed twice."
        )
        code, out, err = run(capsys, "verify", path, "--devices", "2", "--plan", plan_path)
        assert code == 1 and out == ""
        assert one_sentence(err) == expected
        for to in ("mindspore", "dtensor"):
            code, out, err = run(capsys, "export", plan_path, "--to", to, "-o", tmp_path / f"out{i}.{to}")
            assert code == 1 and out == ""
            assert one_sentence(err) == expected
        assert not list(tmp_path.glob(f"out{i}.*"))


# --- a second fuzz run: files a command would overwrite, strategies given twice, wiring, stdout -----------------


def test_an_out_naming_what_the_command_reads_is_refused_before_any_work(capsys, tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(Path(GPT).read_bytes())
    code, out, err = run(capsys, "plan", model, "--devices", "2", "-o", model)
    assert code == 2 and out == ""
    assert one_sentence(err) == f"autopar: error: --out '{model}' is the model itself: name another file."
    assert model.read_bytes() == Path(GPT).read_bytes()
    code, out, err = run(capsys, "plan", model, "--devices", "2", "--format", "json", "-o", tmp_path / "plan.json")
    assert code == 0, err
    plan = tmp_path / "plan.json"
    code, out, err = run(capsys, "export", plan, "--to", "jax", "-o", plan)
    assert code == 2 and f"'{plan}', which this command reads" in one_sentence(err)
    code, out, err = run(capsys, "export", plan, "--to", "jax", "-o", tmp_path)  # said before any work: a flag
    assert code == 2 and "is a directory" in one_sentence(err)


def test_an_out_linking_into_a_missing_folder_is_refused_before_planning(capsys, tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "no" / "such" / "plan.txt")
    code, out, err = run(capsys, "plan", GPT, "--devices", "2", "-o", link)
    assert code == 2 and out == "" and "a link into a folder that does not exist" in one_sentence(err)


def test_an_operator_given_two_strategies_is_refused(capsys, tmp_path):
    fix = ["--mode", "semi_auto_parallel", "--devices", "4"]
    code, out, err = run(capsys, "plan", GPT, *fix, "--fix", "/blocks.0/qkv/MatMul=((2,1,1),(1,2))",
                         "--fix", "/blocks.0/qkv/MatMul=((4,1,1),(1,2))")  # fmt: skip
    assert code == 2 and out == ""
    assert "--fix gives '/blocks.0/qkv/MatMul' two strategies, ((2, 1, 1), (1, 2)) and ((4, 1, 1), (1, 2))" in (
        one_sentence(err)
    )
    strategies = tmp_path / "s.json"
    strategies.write_text('{"/blocks.0/qkv/MatMul": [[2,1,1],[1,2]], "/blocks.0/qkv/MatMul": [[4,1,1],[1,2]]}')
    code, out, err = run(capsys, "plan", GPT, *fix, "--strategies", strategies)
    assert code == 2 and out == ""
    assert one_sentence(err) == (
        f"autopar: error: Strategies file '{strategies}' names operator '/blocks.0/qkv/MatMul' twice: give it one"
        " strategy."
    )


def test_verify_with_a_plan_file_refuses_the_flags_that_would_shape_another(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert run(capsys, "plan", GPT, "--devices", "2", "--format", "json", "-o", plan)[0] == 0
    code, out, err = run(capsys, "verify", GPT, "--devices", "2", "--plan", plan, "--optimizer", "adam")
    assert code == 2 and out == ""
    assert "--plan verifies the plan file as it was made, so it takes no --optimizer" in one_sentence(err)


@pytest.mark.parametrize("devices, said", [("1,,8", "device counts such as"), ("8,1,8", "names 8 more than once")])
def test_a_sweep_over_an_empty_or_repeated_device_count_is_refused(capsys, devices, said):
    code, out, err = run(capsys, "sweep", GPT, "--devices", devices)
    assert code == 2 and out == "" and said in one_sentence(err)


def test_a_full_standard_output_is_one_sentence(capsys, monkeypatch):
    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Full())
    code = main(["schema"])
    assert code == 1
    assert one_sentence(capsys.readouterr().err) == (
        "autopar: error: Cannot write to standard output: No space left on device."
    )


def test_nothing_fitting_over_micro_batches_says_the_leanest_plan_over_the_most_of_them(capsys):
    code, out, err = run(capsys, "plan", RESNET50, "--devices", "1", "--memory-reserve", "31.6GB")
    assert code == 1 and out == ""
    said = one_sentence(err)
    assert said.startswith(
        "autopar: error: Nothing fits in device memory, even over 64 micro-batches: the leanest plan needs 462.69 MB"
    )
    code, out, err = run(capsys, "plan", RESNET50, "--devices", "1", "--memory-reserve", "31.5GB", "--format", "json")
    assert code == 0 and json.loads(out)["memory_plan"]["micro_batches"] == 64  # with 100 MB more, it fits


def test_a_model_inference_cannot_cross_names_the_cause(capsys, tmp_path):
    relu = helper.make_node("Relu", ["y"], ["z"], name="relu")
    z = helper.make_tensor_value_info("z", FLOAT, None)
    cases = {
        "unknown": ([MATMUL, helper.make_node("FooBar", ["y"], ["z"], name="foo")], [x_input([4, 4])], [z], [W]),
        "unwritten": ([MATMUL, relu], [x_input([4, 4])], [z], []),
        "shapeless": ([MATMUL, relu], [helper.make_tensor_value_info("x", FLOAT, None)], [z], [W]),
        "twice": ([MATMUL, relu], [x_input([4, 4])], [z, z], [W]),
    }
    expected = {
        "unknown": "Shape inference stops at FooBar 'foo', which ONNX does not define, so its outputs' shapes are"
        " unknown: export the model without it.",
        "unwritten": "MatMul 'mm' reads 'W', which no operator writes and which is no input or initializer.",
        "shapeless": "Input 'x' declares no shape; autopar needs its sizes to plan.",
        "twice": "Graph output 'z' is listed twice.",
    }
    for name, (nodes, inputs, outputs, inits) in cases.items():
        path = save(tmp_path, nodes, inputs, outputs, inits, name=f"{name}.onnx")
        code, out, err = run(capsys, "plan", path, "--devices", "2")
        assert code == 1 and out == ""
        assert one_sentence(err) == f"autopar: error: {expected[name]}", name


def test_a_batch_the_graph_cannot_take_says_the_batch_it_was_exported_at(capsys):
    code, out, err = run(capsys, "plan", GPT, "--batch", "3")
    assert code == 1 and out == ""
    said = one_sentence(err)
    assert said.startswith("autopar: error: ONNX shape inference failed:")
    assert said.endswith("(at a batch of 3, where the file was exported at 4: its graph may fix that size; plan it at"
                         " its own batch).")  # fmt: skip


def test_one_device_is_one_device_in_the_table(capsys):
    code, out, err = run(capsys, "plan", GPT, "--devices", "1")
    assert code == 0, err
    assert "mesh:             1 device\n" in out and "1 devices" not in out


def test_a_flag_value_starting_with_a_dash_says_how_to_give_it(capsys):
    code, out, err = run(capsys, "plan", GPT, "--memory-reserve", "-4GB")
    assert code == 2 and out == ""
    assert one_sentence(err) == (
        "autopar: error: argument --memory-reserve: expected one argument; a value that starts with '-' goes as"
        " --memory-reserve=VALUE (see 'autopar plan --help')."
    )


def test_an_empty_model_file_and_a_folder_for_a_cost_model_are_named(capsys, tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    code, out, err = run(capsys, "plan", empty)
    assert (code, out) == (1, "")
    assert one_sentence(err) == f"autopar: error: '{empty}' has no operators (is it an ONNX model file?)."
    code, out, err = run(capsys, "plan", GPT, "--cost-model", tmp_path)
    assert (code, out) == (1, "") and one_sentence(err) == (
        f"autopar: error: Cost model '{tmp_path}' is a directory; give a bundled profile's name or a .toml file."
    )


# --- valid models the reference or the importer took badly (a third fuzz run) ------------------------


def test_a_weight_returned_as_an_output_and_an_empty_graph_are_said_for_what_they_are(capsys, tmp_path):
    w_out = helper.make_tensor_value_info("W", FLOAT, [4, 4])
    path = save(tmp_path, [MATMUL], [x_input([4, 4])], [Y, w_out], [W], name="returns_w.onnx")
    code, out, err = run(capsys, "plan", path, "--devices", "2")
    assert (code, out) == (1, "") and one_sentence(err) == (
        "autopar: error: Graph output 'W' is an initializer, returned as it is stored; autopar plans the outputs"
        " operators compute (route it through an Identity to keep it)."
    )
    empty = save(tmp_path, [], [x_input([4, 4])], [helper.make_tensor_value_info("x", FLOAT, [4, 4])], name="e.onnx")
    code, out, err = run(capsys, "plan", empty, "--devices", "2")
    assert (code, out) == (1, "")
    assert one_sentence(err) == f"autopar: error: '{empty}' has no operators: there is nothing to plan."


def test_verify_runs_a_model_whose_operators_repeat_a_name(capsys, tmp_path):
    second = helper.make_node("Relu", ["y"], ["z"], name="mm")  # the MatMul's name again: the importer renames it
    path = save(tmp_path, [MATMUL, second], [x_input([4, 4])], [helper.make_tensor_value_info("z", FLOAT, None)], [W])
    for extra in ((), ("--gradients",)):
        code, _, err = run(capsys, "verify", path, "--devices", "2", *extra)
        assert code == 0, err


def test_a_reference_onnxruntime_cannot_give_is_one_sentence(capsys, tmp_path):
    bf16 = TensorProto.BFLOAT16
    weight = helper.make_tensor("W", bf16, [4, 4], np.ones(16, np.float32).view(np.uint16)[1::2].tolist(), raw=False)
    path = save(tmp_path, [MATMUL], [x_input([4, 4], bf16)], [helper.make_tensor_value_info("y", bf16, None)],
                [weight])  # fmt: skip
    for extra in ((), ("--gradients",)):
        code, _, err = run(capsys, "verify", path, "--devices", "2", *extra)
        assert code == 1, err
        assert "onnxruntime, which computes the reference, cannot run this model:" in one_sentence(err)


def test_a_reference_of_another_shape_than_the_plan_is_one_sentence(capsys, monkeypatch):
    from autopar.spmd import reference

    class Wrong:
        def run(self, names, feeds):
            return [np.zeros((1, 1), np.float32) for _ in names]

    monkeypatch.setattr(reference, "session", lambda model: Wrong())
    code, _, err = run(capsys, "verify", GPT, "--devices", "2")
    assert code == 1 and "onnxruntime, which computes the reference, gives output" in one_sentence(err)
    assert "the shape (1, 1), where ONNX's shape inference, which the plan follows, gives it" in err


def test_verify_without_onnxruntime_says_how_to_install_it(capsys, monkeypatch):
    from autopar.errors import AutoparError
    from autopar.spmd import reference

    def missing():
        raise AutoparError("Verification needs onnxruntime: pip install 'autopar[verify]'.")

    monkeypatch.setattr(reference, "_onnxruntime", missing)
    code, _, err = run(capsys, "verify", GPT, "--devices", "2")
    assert code == 1
    assert one_sentence(err) == "autopar: error: Verification needs onnxruntime: pip install 'autopar[verify]'."


def test_a_bare_reserve_below_a_megabyte_asks_for_its_unit(capsys):
    code, out, err = run(capsys, "plan", GPT, "--memory-reserve", "1.5")
    assert (code, out) == (2, "")
    assert one_sentence(err) == (
        "autopar: error: --memory-reserve 1.5 is 1.5 bytes, less than a megabyte: write its unit (1.5GB, 1.5GiB)"
        " (see 'autopar plan --help')."
    )
    code, out, err = run(capsys, "plan", GPT, "--memory-reserve", "0", "--format", "json")
    assert code == 0 and json.loads(out)["totals"]["memory_reserve_bytes"] == 0  # none at all is a reserve


def test_an_unknown_cost_model_name_is_a_flag_error_and_a_missing_file_an_input_one(capsys, tmp_path):
    code, _, err = run(capsys, "plan", GPT, "--cost-model", "nosuch")
    assert code == 2 and "'nosuch'" in one_sentence(err)
    code, _, err = run(capsys, "plan", GPT, "--cost-model", tmp_path / "missing.toml")
    assert code == 1 and "does not exist" in one_sentence(err)
