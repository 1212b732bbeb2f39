"""What every exporter that writes a Python module shares: it compiles, it needs the model for
shapes, it refuses another model, and the command line writes it where asked."""

from __future__ import annotations

import pytest

from autopar.errors import PlanFileError
from autopar.export import export
from autopar.graph import load_model
from tests.conftest import RESNET50, run_cli

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
