"""`--to onnx`: the model annotated with ONNX's multi-device sharding, read back and verified."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import autopar
from autopar.cli import main
from autopar.export import onnx_sharding
from autopar.export.onnx_sharding import (
    CONFIGURATION,
    PARTIAL_KEY,
    STRATEGY_KEY,
    decode_spec,
    read_annotations,
    read_layouts,
    sharding_spec,
)
from autopar.layout import Layout, shard_index
from autopar.lowering import Plan
from models.resnet50 import build_resnet50
from models.transformer import build_preset
from tests.conftest import run_cli, two_matmul_chain

# a Megatron MLP in layer 0: fc1 split by columns (4 ways), fc2 by rows, its output a partial sum
GPT_FIXED = {"layer0.mlp.fc1": ((2, 1, 1), (1, 4)), "layer0.mlp.fc2": ((2, 1, 4), (4, 1))}


@pytest.fixture(scope="module")
def resnet_plan() -> Plan:
    return autopar.plan("models/resnet50.onnx", devices=8)


@pytest.fixture(scope="module")
def gpt_model() -> onnx.ModelProto:
    return build_preset("gpt2", layers=2, hidden=128, heads=4, seq=64, batch=8)


@pytest.fixture(scope="module")
def gpt_plan(gpt_model) -> Plan:
    return autopar.plan(gpt_model, devices=8, mode="semi_auto_parallel", fixed=GPT_FIXED)


def exported(plan: Plan, tmp_path: Path) -> tuple[Path, onnx.ModelProto]:
    path = tmp_path / "model.sharded.onnx"
    assert autopar.export_plan(plan, "onnx", path) == [path]
    model = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(model)
    return path, model


def check_annotations(plan: Plan, model: onnx.ModelProto) -> None:
    """Every planned node's annotation decodes to the plan's layouts, and only those nodes carry one."""
    assert model.ir_version >= 11
    [config] = [c for c in model.configuration if c.name == CONFIGURATION]
    assert config.num_devices == plan.file.devices
    layouts = read_layouts(model)
    assert layouts is not None
    assert set(layouts) == {op.name for op in plan.file.without_forks().ops}
    for op in plan.file.without_forks().ops:
        want = {entry.tensor: entry.layout.layout() for entry in [*op.inputs, *op.outputs]}
        assert layouts[op.name] == want, op.name
    annotated = [n for n in model.graph.node if n.device_configurations]
    assert len(annotated) == len(plan.file.without_forks().ops)
    assert read_annotations(model) == plan.file.without_forks().strategies


def test_resnet50_export(resnet_plan, tmp_path):
    _, model = exported(resnet_plan, tmp_path)
    check_annotations(resnet_plan, model)
    conv1 = next(n for n in model.graph.node if n.name == "conv1")
    [config] = conv1.device_configurations
    specs = {spec.tensor_name: spec for spec in config.sharding_spec}
    images = specs["images"]  # the batch split 8 ways: one device per shard, in rank order
    assert [(d.axis, d.simple_sharding[0].num_shards) for d in images.sharded_dim] == [(0, 8), (1, 1), (2, 1), (3, 1)]
    assert [d.simple_sharding[0].dim_value for d in images.sharded_dim] == resnet_plan.file.context.inputs["images"]
    assert list(images.device) == list(range(8)) and not images.index_to_device_group_map
    weight = specs["conv1.weight"]  # replicated: one group of all eight
    assert list(weight.device) == [-1]
    assert [(e.key, list(e.value)) for e in weight.index_to_device_group_map] == [(-1, list(range(8)))]
    onehot = next(n for n in model.graph.node if n.name == "loss.onehot")  # its strategy counts output axes
    assert json.loads({p.key: p.value for p in onehot.metadata_props}[STRATEGY_KEY]) == [[8, 1], [], [1]]


def test_gpt_export_tensor_parallel(gpt_plan, tmp_path):
    _, model = exported(gpt_plan, tmp_path)
    check_annotations(gpt_plan, model)
    fc2 = next(n for n in model.graph.node if n.name == "layer0.mlp.fc2")
    specs = {spec.tensor_name: spec for spec in fc2.device_configurations[0].sharding_spec}
    weight = specs["layer0.mlp.fc2.weight"]  # rows split by bits (1, 0), replicated over bit 2
    assert [d.simple_sharding[0].num_shards for d in weight.sharded_dim] == [4, 1]
    groups = {e.key: list(e.value) for e in weight.index_to_device_group_map}
    assert [groups[key] for key in weight.device] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    out = specs["layer0.mlp.fc2"]  # a partial sum over bits 1 and 0: the groups reduce, metadata says so
    groups = {e.key: list(e.value) for e in out.index_to_device_group_map}
    assert [groups[key] for key in out.device] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    partial = json.loads({p.key: p.value for p in fc2.metadata_props}[PARTIAL_KEY])
    assert partial == {"layer0.mlp.fc2": {"bits": [1, 0], "op": "sum"}}


def test_round_trip_verify_uses_the_annotations(gpt_model, gpt_plan, tmp_path):
    path, _ = exported(gpt_plan, tmp_path)
    report = autopar.verify(path, devices=8)  # no plan: the annotations are the plan
    assert report.ok, report.problems
    assert report.planned == autopar.verify(gpt_model, gpt_plan).planned
    assert report.planned != autopar.verify(gpt_model, devices=8).planned  # not the plan a search finds
    with pytest.raises(autopar.AutoparError, match="annotated for 8 devices"):
        autopar.verify(path, devices=4)


def test_round_trip_verify_tiny_resnet(tmp_path):
    model = build_resnet50(batch=8, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1))
    plan = autopar.plan(model, devices=8)
    path, annotated = exported(plan, tmp_path)
    check_annotations(plan, annotated)
    report = autopar.verify(path, devices=8)
    assert report.ok, report.problems


def test_cli_round_trip(gpt_plan, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(gpt_plan.to_json())
    model_path = tmp_path / "gpt.onnx"
    onnx.save(gpt_plan.problem.graph.model, str(model_path))
    out = tmp_path / "gpt.sharded.onnx"
    assert main(["export", str(plan_path), "--to", "onnx", "--model", str(model_path), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    assert main(["verify", str(out), "--devices", "8"]) == 0
    err = capsys.readouterr().err
    assert err.strip() == f"autopar: verifying the plan annotated in {out} (8 devices)"


def test_cli_without_model_is_one_sentence(resnet_plan, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(resnet_plan.to_json())
    assert main(["export", str(plan_path), "--to", "onnx", "-o", str(tmp_path / "x.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and err.startswith("autopar: error: ")
    assert not (tmp_path / "x.onnx").exists()


def test_cli_plan_for_another_model(resnet_plan, gpt_model, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(resnet_plan.to_json())
    model_path = tmp_path / "gpt.onnx"
    onnx.save(gpt_model, str(model_path))
    code = main(["export", str(plan_path), "--to", "onnx", "--model", str(model_path), "-o", str(tmp_path / "x.onnx")])
    assert code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another model" in err


def test_unannotated_model_reads_none(gpt_model):
    assert read_annotations(gpt_model) is None


@pytest.mark.parametrize(
    "layout",
    [Layout(((2, 1, 0), (), ())), Layout(((0,), (), (2,))), Layout(((), (1,))), Layout(((),)), Layout(())],
)
def test_spec_encodes_shard_index(layout):
    """Device d holds, on each axis, the shard its bits spell; a spec decodes back to its layout."""
    spec = sharding_spec("t", layout, 3, [16] * layout.ndim)
    groups = {e.key: list(e.value) for e in spec.index_to_device_group_map}
    splits = [d.simple_sharding[0].num_shards for d in spec.sharded_dim]
    for position, entry in enumerate(spec.device):
        shard, rest = [], position
        for n in reversed(splits):
            shard.append(rest % n)
            rest //= n
        shard.reverse()
        for rank in groups.get(entry, [entry]):
            assert shard == [shard_index(rank, bits) for bits in layout.dims]
    assert decode_spec(spec, 8) == layout


def test_a_model_whose_external_weights_are_missing_exports(tmp_path, capsys, monkeypatch):
    """The importer never reads a model's external weights, nor does the export: onnx.checker checks the
    annotated model without them (it would look for them from the working folder), and the file written
    keeps its references to them."""
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "chain.onnx"
    onnx.save(
        two_matmul_chain(), str(path), save_as_external_data=True, location="chain.onnx.weights", size_threshold=0
    )
    (folder / "chain.onnx.weights").unlink()  # the .onnx copied alone
    plan = autopar.plan(path, devices=4)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "chain.sharded.onnx"
    code, _, err = run_cli(capsys, "export", plan_path, "--to", "onnx", "--model", path, "-o", out)
    assert code == 0, err
    annotated = onnx.load(str(out), load_external_data=False)
    assert read_annotations(annotated) == plan.file.strategies
    locations = {e.value for t in annotated.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"chain.onnx.weights"}
    annotated.graph.node[0].op_type = "NoSuchOp"  # the checker still checks the rest
    monkeypatch.setattr(onnx_sharding, "annotate", lambda plan, model: annotated)
    with pytest.raises(autopar.AutoparError, match=r"does not pass onnx\.checker: No Op registered for NoSuchOp"):
        onnx_sharding.write(plan.file, annotated, tmp_path / "broken.onnx")
