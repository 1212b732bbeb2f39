"""`autopar.graph.records`: a BatchNorm the dynamo exporter recorded as training is planned as one."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

import autopar
from autopar.cost import HardwareProfile
from autopar.errors import StrategyError
from autopar.graph.records import restore_training_batch_norms
from tests.conftest import simple_profile_dict

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face ResNet in training, exported unoptimised (its BatchNorms kept)."""
    from tests.hf_families import FAMILIES, export

    family = FAMILIES["resnet"]
    path = tmp_path_factory.mktemp("resnet") / "resnet.onnx"
    export(family.build(1), family.batch(4, 0), str(path), optimize=False)
    return str(path)


def test_the_recorded_training_form_is_restored(resnet: str) -> None:
    proto = onnx.load(resnet)
    norms = [node for node in proto.graph.node if node.op_type == "BatchNormalization"]
    assert norms and not any(attribute.name == "training_mode" for node in norms for attribute in node.attribute)
    assert restore_training_batch_norms(proto) == len(norms)
    assert restore_training_batch_norms(proto) == 0  # once
    onnx.checker.check_model(proto, full_check=True)  # three outputs, as the training form has


def test_batch_statistics_keep_batch_and_space_whole(resnet: str) -> None:
    """A plan that must shard (a small device) splits BatchNorms by channel only, and verifies both ways."""
    need = autopar.plan(resnet, devices=8).file.totals.memory_per_device_bytes
    profile = HardwareProfile.model_validate(simple_profile_dict(need * 0.5))
    plan = autopar.plan(resnet, devices=8, cost_model=profile)
    norms = [op for op in plan.file.ops if op.op_type == "BatchNormalization"]
    assert norms
    for op in norms:
        dims = op.inputs[0].layout.dims
        assert not dims[0] and not any(dims[2:]), (op.name, dims)
    assert any(op.inputs[0].layout.dims[1] for op in norms)  # channels split: the plan is not replicated
    report = autopar.verify(resnet, plan, devices=8, cost_model=profile, gradients=True)
    assert report.ok, report


def test_micro_batches_are_refused(resnet: str) -> None:
    assert autopar.plan(resnet, devices=8).file.memory_plan.micro_batches == 1
    with pytest.raises(StrategyError, match=r"batch's statistics.*micro_batches=1"):
        autopar.plan(resnet, devices=8, micro_batches=2)


def test_an_inference_export_is_left_as_it_is(tmp_path: Path) -> None:
    """No record, or an inference BatchNorm's: nothing changes (the bundled ResNet-50 plans as before)."""
    proto = onnx.load(str(Path(__file__).resolve().parents[1] / "models" / "resnet50.onnx"), load_external_data=False)
    assert restore_training_batch_norms(proto) == 0
