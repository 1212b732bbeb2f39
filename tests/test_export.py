"""What every exporter that writes a Python module shares: it compiles, it needs the model for
shapes, it refuses another model, and the command line writes it where asked."""

from __future__ import annotations

import json

import onnx
import pytest

from autopar.errors import PlanFileError
from autopar.export import export
from autopar.graph import load_model
from tests.conftest import RESNET50, run_cli, two_matmul_chain

MODULE_FORMATS = {"dtensor": "'embed.tok.weight': Spec(None, ", "jax": "'embed.tok.weight': Spec(None, P("}


@pytest.mark.parametrize("to", sorted(MODULE_FORMATS))
def test_without_the_model_the_module_has_no_shapes(to, gpt_plan, tmp_path):
    [path] = export(gpt_plan.file, to, tmp_path / "bare.py")
    text = path.read_text(encoding="utf-8")
    compile(text, str(path), "exec")
    assert "SHAPES_KNOWN = False" in text and MODULE_FORMATS[to] in text


@pytest.mark.parametrize("to", sorted(MODULE_FORMATS))
def test_another_model_is_refused(to, gpt_plan, tmp_path):
    with pytest.raises(PlanFileError, match="another model"):
        export(gpt_plan.file, to, tmp_path / "other.py", load_model(RESNET50).model)


@pytest.mark.parametrize("to", sorted(MODULE_FORMATS))
def test_command_line(to, gpt_plan, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(gpt_plan.file.model_dump_json(by_alias=True), encoding="utf-8")
    out = tmp_path / f"gpt_{to}.py"
    code, _, err = run_cli(capsys, "export", plan_path, "--to", to, "-o", out)
    assert code == 0 and out.name in err
    compile(out.read_text(encoding="utf-8"), out.name, "exec")


@pytest.mark.parametrize("to", ["dtensor", "jax", "mindspore", "onnx"])
def test_an_edited_plan_file_is_one_sentence_for_every_format(to, gpt_plan, tmp_path, capsys):
    """A layout naming a mesh bit twice is refused when the file is read, not by an exporter's assertion."""
    data = gpt_plan.to_dict()
    next(op for op in data["ops"] if op["name"] == "layer0.attn.q")["inputs"][0]["layout"]["dims"] = [[0], [0], []]
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(data), encoding="utf-8")
    model_path = tmp_path / "gpt.onnx"
    onnx.save(gpt_plan.problem.graph.model, str(model_path))
    out = tmp_path / f"out_{to}"
    code, _, err = run_cli(capsys, "export", plan_path, "--to", to, "--model", model_path, "-o", out)
    assert code == 1 and err.count("\n") == 1 and "internal error" not in err, err
    assert "(operator 'layer0.attn.q'): mesh bit 0 is used twice in the layout [[0], [0], []]" in err
    assert not out.exists()


@pytest.mark.parametrize("to", ["dtensor", "jax", "mindspore", "onnx"])
def test_a_plan_without_its_context_is_checked_against_the_model(to, gpt_plan, tmp_path):
    old = gpt_plan.file.model_copy(update={"context": None})  # as files from before plans recorded their model
    with pytest.raises(PlanFileError, match=r"The plan lists operator 'embed\.tok' \(Gather\), which model"):
        export(old, to, tmp_path / "other", two_matmul_chain())
    assert not (tmp_path / "other").exists()
