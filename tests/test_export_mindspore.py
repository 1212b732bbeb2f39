"""The ``mindspore`` export: MindSpore's strategy checkpoint and the shard() snippet.

The checkpoint is read back with autopar's own message classes (and, where MindSpore is installed,
with ``mindspore.train.node_strategy_pb2`` and MindSpore's layout helpers): every operator's
strategy is the plan's, and every parameter's (dev_matrix, tensor_map) gives each rank the shard
autopar's layout gives it.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

import autopar
from autopar.export import mindspore as export_ms
from autopar.export import node_strategy_pb2 as pb
from autopar.layout import Layout
from tests.conftest import run_cli, simple_profile_dict, two_matmul_chain

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def optimizer_plan():
    """Z = (X @ W1) @ W2 on 4 devices with memory for nothing but the parallel optimizer (W1, W2 over bit 1)."""
    from autopar.cost import HardwareProfile

    profile = HardwareProfile.model_validate(simple_profile_dict(928))
    model = two_matmul_chain(batch=16, d_in=8, d_hidden=16, d_out=4)
    # one stage over the whole batch: micro-batches and pipeline stages are other ways to fit
    plan = autopar.plan(model, devices=4, cost_model=profile, pipeline_stages=1, micro_batches=1)
    assert plan.file.memory_plan.parallel_optimizer == ["W1", "W2"]
    return plan


PLANS = ["resnet_plan", "gpt_plan", "optimizer_plan"]


def exported(plan, tmp_path: Path) -> tuple[Path, Path]:
    written = autopar.export_plan(plan, "mindspore", tmp_path / "plan.strategy.ckpt")
    assert written == [tmp_path / "plan.strategy.ckpt", tmp_path / "plan.strategy.py"]
    return written[0], written[1]


def ms_shard_index(rank: int, dev_matrix: list[int], entry) -> int:
    """MindSpore's shard of one tensor dimension on ``rank``: coordinates over the device matrix
    (last axis fastest), tensor-map axes counted from the right, nested axes outer first."""
    index = 0
    for axis in entry if isinstance(entry, list) else [entry]:
        if axis == -1:
            continue
        size = dev_matrix[len(dev_matrix) - 1 - axis]
        stride = math.prod(dev_matrix[len(dev_matrix) - axis :])
        index = index * size + (rank // stride) % size
    return index


def tensor_maps(layouts) -> list:
    """The tensor map a ParallelLayouts message holds, flat or nested (as MindSpore reads it)."""
    if len(layouts.tensor_map) > 1:
        return [list(m.dim) if len(m.dim) > 1 else m.dim[0] for m in layouts.tensor_map]
    return list(layouts.tensor_map[0].dim)


# --- the format -----------------------------------------------------------------------------------


def test_proto_file_declares_the_messages_the_module_builds():
    text = (REPO / "autopar" / "export" / "node_strategy.proto").read_text()
    assert 'syntax = "proto2";' in text and f"package {pb.PACKAGE};" in text
    declared = {}
    for name, body in re.findall(r"message (\w+) \{(.*?)\}", text, flags=re.S):
        fields = re.findall(r"(required|repeated|optional) (\w+) (\w+) = (\d+);", body)
        declared[name] = [(field, int(number), label, kind) for label, kind, field, number in fields]
    labels = {pb.REQUIRED: "required", pb.REPEATED: "repeated"}
    built = {
        name: [(field, number, labels[label], kind) for field, number, label, kind in fields]
        for name, fields in pb.MESSAGES.items()
    }
    assert declared == built


def message_types(file_descriptor) -> list:
    """The file's messages as DescriptorProtos: names, fields, numbers, types, labels and type names."""
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    return list(proto.message_type)


def test_optimizer_shard_fields_follow_mindspore():
    assert [export_ms.optimizer_shard_step(bits) for bits in ([0], [1], [2, 1], [2, 1, 0])] == [1, 2, 2, 1]


# --- ResNet-50 and GPT at 8 devices, and a parallel-optimizer plan ---------------------------------


@pytest.mark.parametrize("fixture", PLANS)
def test_checkpoint_strategies_are_the_plans(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    checkpoint, _ = exported(plan, tmp_path)
    data = checkpoint.read_bytes()
    message = pb.ParallelStrategyMap.FromString(data)
    assert message.current_stage == 0
    assert [item.node_name for item in message.parallel_strategy_item] == [
        op.name for op in plan.file.without_forks().ops
    ]
    assert all(item.parallel_strategys.stage == 0 for item in message.parallel_strategy_item)
    assert export_ms.read_strategies(data) == plan.file.without_forks().strategies


@pytest.mark.parametrize("fixture", PLANS)
def test_parameter_layouts_give_every_rank_its_shard(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    message = pb.ParallelStrategyMap.FromString(exported(plan, tmp_path)[0].read_bytes())
    items = {item.param_name: item.parallel_layouts for item in message.parallel_layout_item}
    graph = plan.problem.graph
    assert set(items) == {t.name for t in graph.tensors.values() if t.kind == "parameter"}
    syncs = {sync.parameter: sync for sync in plan.file.gradient_sync}
    assert set(syncs) <= set(items)
    for name, layouts in items.items():
        dev_matrix = list(layouts.dev_matrix[0].dim)
        tmap = tensor_maps(layouts)
        assert math.prod(dev_matrix) == plan.file.devices
        assert layouts.field == 0
        assert list(layouts.param_split_shape[0].dim) == [] == list(layouts.indices_offset[0].dim)
        sync = syncs.get(name)
        layout = sync.layout.layout() if sync else reader_layout(plan, name)
        assert len(tmap) == layout.ndim
        assert export_ms.split_factors(dev_matrix, tmap) == [layout.split(d) for d in range(layout.ndim)]
        for rank in range(plan.file.devices):
            for dim in range(layout.ndim):
                assert ms_shard_index(rank, dev_matrix, tmap[dim]) == layout.shard_index(rank, dim), (name, rank)
        # the owning operator's in_strategy for this input is the same split
        op = next(op for op in plan.file.ops if op.name == (sync.op if sync else reader(plan, name).name))
        position = [entry.tensor for entry in op.inputs].index(name)
        assert tuple(op.strategy[position]) == tuple(export_ms.split_factors(dev_matrix, tmap))
        if sync is not None and sync.optimizer_shards:
            assert layouts.opt_weight_shard_size == sync.optimizer_shards
            assert layouts.opt_weight_shard_step == export_ms.optimizer_shard_step(sync.bits)
        else:
            assert layouts.opt_weight_shard_size == 0 == layouts.opt_weight_shard_step


def reader(plan, name):
    return next(op for op in plan.file.ops if name in [entry.tensor for entry in op.inputs])


def reader_layout(plan, name) -> Layout:
    return next(entry.layout.layout() for entry in reader(plan, name).inputs if entry.tensor == name)


def test_the_parallel_optimizer_fills_the_shard_fields(optimizer_plan, tmp_path):
    message = pb.ParallelStrategyMap.FromString(exported(optimizer_plan, tmp_path)[0].read_bytes())
    items = {item.param_name: item.parallel_layouts for item in message.parallel_layout_item}
    # mm1 ((2, 1), (1, 2)): batch on bit 1, W1's columns on bit 0; W1's optimizer shards over bit 1
    assert list(items["W1"].dev_matrix[0].dim) == [2, 2] and list(items["W1"].tensor_map[0].dim) == [-1, 0]
    assert (items["W1"].opt_weight_shard_size, items["W1"].opt_weight_shard_step) == (2, 2)
    assert (items["W2"].opt_weight_shard_size, items["W2"].opt_weight_shard_step) == (2, 2)


def test_device_matrix_merges_adjacent_bits_and_nests_the_rest():
    x, w, y = Layout(((2,), ())), Layout(((), (1, 0))), Layout(((2,), (1, 0)))
    runs = export_ms.device_matrix([x, w, y], 3)
    assert runs == [(2,), (1, 0)] and export_ms.tensor_map(y, runs) == [1, 0]
    # bit order (0, 1) cannot be one axis: two, outer first
    odd = Layout(((0, 1), ()))
    runs = export_ms.device_matrix([odd], 2)
    assert runs == [(1,), (0,)] and export_ms.tensor_map(odd, runs) == [[0, 1], -1]
    for rank in range(4):
        assert ms_shard_index(rank, [2, 2], [0, 1]) == odd.shard_index(rank, 0)
    # partial bits form their own axis; unused bits the repeated one
    partial = Layout(((3,), ()), partial=(1, 0))
    assert export_ms.device_matrix([partial], 4) == [(3,), (2,), (1, 0)]


# --- the snippet and the command line -------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_snippet_names_every_node_with_its_primitive(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    _, code = exported(plan, tmp_path)
    text = code.read_text()
    compile(text, str(code), "exec")
    for op in plan.file.without_forks().ops:
        assert f"# {op.name}: ONNX {op.op_type}" in text
        assert op.op_type in export_ms.PRIMITIVES
    assert "ops.Conv2D(" in text or "ops.MatMul(" in text or "ops.BatchMatMul(" in text


def test_gemm_is_a_matmul_and_a_bias_add(resnet_plan, tmp_path):
    text = exported(resnet_plan, tmp_path)[1].read_text()
    fc = next(op for op in resnet_plan.file.ops if op.op_type == "Gemm")
    a, b = (tuple(s) for s in fc.strategy[:2])
    assert f"fc = ops.MatMul(transpose_b=True).shard({(a, b)!r})" in text
    out = fc.outputs[0].layout.layout()
    assert f"fc_bias = ops.BiasAdd().shard((({out.split(0)}, {out.split(1)}), ({out.split(1)},)))" in text


def test_a_py_out_is_the_snippet_and_the_checkpoint_goes_beside(gpt_plan, tmp_path):
    written = autopar.export_plan(gpt_plan, "mindspore", tmp_path / "gpt.py")
    assert written == [tmp_path / "gpt.ckpt", tmp_path / "gpt.py"]
    assert export_ms.read_strategies((tmp_path / "gpt.ckpt").read_bytes()) == gpt_plan.file.without_forks().strategies


def test_cli_exports_a_plan_file(resnet_plan, tmp_path, capsys):
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(resnet_plan.to_json())
    out = tmp_path / "r50.ckpt"
    code, _, err = run_cli(capsys, "export", plan_json, "--to", "mindspore", "-o", out)
    assert code == 0, err
    assert f"wrote {out}" in err and f"wrote {tmp_path / 'r50.py'}" in err
    message = pb.ParallelStrategyMap.FromString(out.read_bytes())
    assert export_ms.read_strategies(out.read_bytes()) == resnet_plan.file.without_forks().strategies
    # without --model only the trainable parameters (the gradient sync) have layouts
    assert {item.param_name for item in message.parallel_layout_item} == {
        sync.parameter for sync in resnet_plan.file.gradient_sync
    }


def test_an_unwritable_out_is_one_sentence(gpt_plan, tmp_path):
    with pytest.raises(autopar.AutoparError, match="Cannot write"):
        autopar.export_plan(gpt_plan, "mindspore", tmp_path / "missing" / "plan.ckpt")


# --- MindSpore's own module (skipped where MindSpore is not installed) -----------------------------


@pytest.fixture(scope="module")
def mindspore_pb2():
    pytest.importorskip("mindspore")
    from mindspore.train import node_strategy_pb2

    return node_strategy_pb2


def test_descriptor_equals_mindspores(mindspore_pb2):
    assert message_types(pb.DESCRIPTOR) == message_types(mindspore_pb2.DESCRIPTOR)
    assert mindspore_pb2.DESCRIPTOR.package == pb.PACKAGE


@pytest.mark.parametrize("fixture", PLANS)
def test_mindspore_reads_the_checkpoint(fixture, request, tmp_path, mindspore_pb2):
    import mindspore as ms
    from mindspore.parallel._parallel_serialization import _convert_to_list
    from mindspore.parallel._tensor import (
        _construct_tensor_layout_for_opt_shard,
        _get_tensor_slice_index,
        _get_tensor_strategy,
    )

    plan = request.getfixturevalue(fixture)
    checkpoint, _ = exported(plan, tmp_path)
    theirs = mindspore_pb2.ParallelStrategyMap.FromString(checkpoint.read_bytes())
    strategies = {
        item.node_name: tuple(tuple(s.dim) for s in item.parallel_strategys.parallel_strategy)
        for item in theirs.parallel_strategy_item
    }
    assert strategies == plan.file.without_forks().strategies
    ours = pb.ParallelStrategyMap.FromString(checkpoint.read_bytes())
    assert theirs.SerializeToString() == ours.SerializeToString() == checkpoint.read_bytes()

    layouts = _convert_to_list(ms.build_searched_strategy(str(checkpoint)))
    syncs = {sync.parameter: sync for sync in plan.file.gradient_sync}
    graph = plan.problem.graph
    for name, (dev_matrix, tmap, _split, field, step, size, stages) in layouts.items():
        layout = syncs[name].layout.layout() if name in syncs else reader_layout(plan, name)
        assert (field, stages) == (0, [0])
        strategy = _get_tensor_strategy(dev_matrix, tmap)
        assert strategy == [layout.split(d) for d in range(layout.ndim)]
        if not any(isinstance(entry, list) for entry in tmap):
            for rank in range(plan.file.devices):
                slice_index = _get_tensor_slice_index(dev_matrix, strategy, tmap, rank)
                expected = 0
                for dim in range(layout.ndim):
                    expected = expected * layout.split(dim) + layout.shard_index(rank, dim)
                assert int(slice_index) == expected, (name, rank)
        if size:  # MindSpore accepts the optimizer shard: one more split of the first dimension
            shape = list(graph.tensor(name).shape)
            _, new_map, new_shape = _construct_tensor_layout_for_opt_shard(dev_matrix, tmap, step, size, shape)
            assert len(new_map) == len(shape) + 1 and math.prod(new_shape) == math.prod(shape)


@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_mindspore_runs_the_snippet(fixture, request, tmp_path, mindspore_pb2):
    plan = request.getfixturevalue(fixture)
    code = exported(plan, tmp_path)[1]
    namespace: dict = {}
    exec(compile(code.read_text(), str(code), "exec"), namespace)
    sharded = namespace["SHARDED"]
    assert sharded, "no primitive was sharded"
    for op in plan.file.without_forks().ops:
        if op.name not in sharded:
            continue
        primitive = export_ms.PRIMITIVES[op.op_type]
        assert primitive is not None
        expected = tuple(tuple(s) for s in op.strategy)[: primitive.inputs]
        assert sharded[op.name].attrs["in_strategy"] == expected, op.name


def test_every_primitive_in_the_table_exists_in_mindspore(mindspore_pb2):
    import functools

    from mindspore import ops

    for op_type, primitive in export_ms.PRIMITIVES.items():
        if primitive is not None:  # a dotted name below mindspore.ops (FlashAttentionScore is in ops.operations.nn_ops)
            path = primitive.name.removeprefix("ops.").split(".")
            found = functools.reduce(lambda module, name: getattr(module, name, None), path, ops)
            assert found is not None, (op_type, primitive.name)


def test_the_checkpoint_classes_load_under_either_protobuf():
    # MindSpore selects pure-Python protobuf through the environment, which child processes inherit
    import os
    import subprocess

    for implementation in ("python", "upb"):
        env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation}
        code = "from autopar.export import node_strategy_pb2 as pb; print(pb.ParallelStrategyMap.DESCRIPTOR.name)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
        assert done.stdout.strip() == "ParallelStrategyMap", done.stderr


def test_a_loss_that_reads_its_labels_whole_is_written_as_mindspore_can_run_it(tmp_path):
    """Hugging Face's loss (a mean skipping ignored labels) splits its scores by samples and reads its labels
    whole; MindSpore's primitive needs each device's labels to be its logits' samples, so the checkpoint
    splits them alike, and the snippet says what differs."""
    from tests.conftest import profile

    model = Path(__file__).parent / "data" / "hf_qwen3_dynamo.onnx"
    plan = autopar.plan(model, devices=8, cost_model=profile(peak=1e9))
    loss = next(op for op in plan.file.ops if op.op_type == "SoftmaxCrossEntropyLoss")
    samples = loss.strategy[0][0]
    assert samples > 1 and list(loss.strategy[1]) == [1]
    written = export_ms.read_strategies(export_ms.strategy_map(plan.file).SerializeToString())[loss.name]
    assert written == (tuple(loss.strategy[0]), (samples,))
    snippet = export_ms.snippet(plan.file)
    assert "whole batch's count of labels not ignored" in snippet
    assert f".shard((({samples}, 1), ({samples},)))" in snippet
