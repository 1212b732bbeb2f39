"""SPMD verification: plans and random candidate assignments run on virtual devices and match one device."""

from __future__ import annotations

import json
import random

import pytest

import autopar
from autopar.cli import main
from autopar.lowering import Plan
from autopar.search.driver import SearchResult
from models.resnet50 import build_resnet50
from tests.conftest import random_model, two_matmul_chain

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def tiny_resnet():
    return build_resnet50(batch=8, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1))


@pytest.mark.parametrize("mode", ["auto_parallel", "data_parallel", "stand_alone"])
def test_modes_verify(tiny_resnet, mode):
    plan = autopar.plan(tiny_resnet, devices=8, mode=mode)
    report = autopar.verify(tiny_resnet, plan)
    assert report.ok, report.problems
    assert set(report.outputs) == {"loss", "logits"}
    assert all(entry["max_abs_error"] <= 1e-4 for entry in report.outputs.values())
    assert report.executed == report.planned


MODELS = {
    "tiny_resnet": lambda: build_resnet50(batch=8, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1)),
    "two_matmul_chain": lambda: two_matmul_chain(batch=8, d_in=8, d_hidden=16, d_out=8),
    "random_graph": lambda: random_model(12345),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_random_candidate_assignments_verify(name):
    model = MODELS[name]()
    candidates = autopar.candidates(model, devices=8)
    rng = random.Random(sum(map(ord, name)))
    executed_kinds = set()
    for draw in range(20):
        strategies = {op: rng.choice(options) for op, options in candidates.items()}
        report = autopar.verify(model, strategies, devices=8, seed=draw)
        assert report.ok, (draw, report.problems)
        assert report.executed == report.planned
        executed_kinds |= set(report.executed)
    if name == "tiny_resnet":  # random plans exercise every kind of step
        assert {"AllGather", "AllToAll", "ReduceScatter", "AllReduce", "Slice"} <= executed_kinds


def test_reduced_resnet50_verifies():
    # all 16 bottleneck blocks, small images and batch, as CI can afford
    model = build_resnet50(batch=8, num_classes=32, image_size=32, width=8)
    for mode in ("auto_parallel", "data_parallel"):
        report = autopar.verify(model, autopar.plan(model, devices=8, mode=mode))
        assert report.ok, report.problems


def _plan_dict(model, strategies) -> dict:
    problem = autopar.build(model, 8)
    choice = tuple(problem.choice_for(strategies))
    return Plan(problem, choice, SearchResult(choice, "given", 0.0), "tiny", "given", "ascend910", "mixed").to_dict()


def test_broken_plan_file_is_caught(tmp_path, tiny_resnet, capsys):
    import onnx

    model_path = tmp_path / "tiny.onnx"
    onnx.save(tiny_resnet, model_path)
    candidates = autopar.candidates(tiny_resnet, devices=8)
    rng = random.Random(3)
    strategies = {op: rng.choice(options) for op, options in candidates.items()}
    data = _plan_dict(tiny_resnet, strategies)
    good = tmp_path / "plan.json"
    good.write_text(json.dumps(data))
    assert main(["verify", str(model_path), "--devices", "8", "--plan", str(good)]) == 0
    # remove one real collective from the plan file
    entry = next(r for r in data["redistributions"] if any(s["collective"] != "Slice" for s in r["steps"]))
    entry["steps"] = [s for s in entry["steps"] if s["collective"] == "Slice"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["verify", str(model_path), "--devices", "8", "--plan", str(broken)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out
    assert "does not verify" in captured.err and entry["tensor"] in captured.err and "missing" in captured.err
    assert captured.err.count("\n") == 1


def test_plan_for_other_device_count_is_refused(tmp_path, tiny_resnet):
    data = autopar.plan(tiny_resnet, devices=4).to_dict()
    with pytest.raises(autopar.AutoparError, match="4 devices"):
        autopar.verify(tiny_resnet, data, devices=8)


def test_a_plan_file_is_verified_without_costing_the_model(monkeypatch, tiny_resnet):
    import autopar.api.verification
    import autopar.search.costing

    data = autopar.plan(tiny_resnet, devices=8).to_dict()

    def no_costing(*args, **kwargs):
        raise AssertionError("verifying a plan file costed the model")

    monkeypatch.setattr(autopar.api.verification, "build_problem", no_costing)
    monkeypatch.setattr(autopar.search.costing, "build_problem", no_costing)
    report = autopar.verify(tiny_resnet, data, devices=8)
    assert report.ok, report.problems


def test_a_plan_files_program_is_the_plans_own(tiny_resnet):
    from autopar.cost import CostModel
    from autopar.lowering import program_from_file

    plan = autopar.plan(tiny_resnet, devices=8)
    mine = plan.program
    read = program_from_file(mine.graph, plan.file, 8, CostModel(plan.problem.cost.profile, "mixed"))
    assert [op.exponents for op in read.ops] == [op.exponents for op in mine.ops]
    assert [(op.inputs, op.outputs) for op in read.ops] == [(op.inputs, op.outputs) for op in mine.ops]
    assert [op.gradient_bits for op in read.ops] == [op.gradient_bits for op in mine.ops]
    assert dict(read.owner) == dict(mine.owner) and dict(read.requires_grad) == dict(mine.requires_grad)
    assert dict(read.activation_itemsizes) == dict(mine.activation_itemsizes)
    assert read.gradient_itemsize == mine.gradient_itemsize
    assert (read.redistributions, read.gradients, read.gradient_sync) == (
        mine.redistributions,
        mine.gradients,
        mine.gradient_sync,
    )


def test_an_fp32_plan_file_verifies_at_its_own_precision(tiny_resnet):
    data = autopar.plan(tiny_resnet, devices=8, precision="fp32").to_dict()
    report = autopar.verify(tiny_resnet, data, devices=8)  # the collectives' bytes are the plan's, in fp32
    assert report.ok, report.problems


def test_a_forward_check_counts_every_ranks_copies_before_drawing_anything(monkeypatch, tiny_resnet):
    """Each of 8 ranks holds its own copy of what it does not split: a stand-alone plan's check holds
    the activations nine times (the reference's and eight ranks'), and is refused up front when that
    exceeds the limit even though the weights and one copy of the activations would fit."""
    import numpy as np

    from autopar.errors import TooLargeError
    from autopar.spmd import runner

    plan = autopar.plan(tiny_resnet, devices=8, mode="stand_alone")
    program = plan.program
    tensors = program.graph.tensors.values()
    values = sum(t.numel * np.dtype(t.dtype).itemsize for t in tensors if t.kind != "activation")
    activations = sum(t.numel * np.dtype(t.dtype).itemsize for t in tensors if t.kind == "activation")
    need = runner.verification_bytes(program)
    assert need >= 3 * values + activations + 7 * activations  # eight ranks' whole outputs, graph outputs aside
    monkeypatch.setattr(runner, "MAX_VERIFY_BYTES", need - 1)
    monkeypatch.setattr(runner, "materialise", lambda *a, **k: pytest.fail("values drawn before the refusal"))
    with pytest.raises(TooLargeError, match="on fewer devices"):
        autopar.verify(tiny_resnet, plan)
    monkeypatch.setattr(runner, "MAX_VERIFY_BYTES", need)
    monkeypatch.undo()
    assert autopar.verify(tiny_resnet, plan).ok


def test_verify_without_a_plan_runs_the_plan_that_plan_prints(monkeypatch):
    """`autopar verify MODEL` with no plan verifies the plan `autopar plan MODEL` prints for the same options
    (the whole search: micro-batches and recomputation where memory binds), not another search's."""
    from autopar.api import verification
    from models.transformer import build_transformer
    from tests.conftest import profile

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=8)
    free = autopar.plan(model, devices=4, cost_model=profile())
    tight = profile(capacity=0.6 * free.memory_per_device)
    printed = autopar.plan(model, devices=4, cost_model=tight)
    assert printed.strategies != free.strategies or printed.search.choices != free.search.choices
    verified = []
    run = verification.verify_program
    monkeypatch.setattr(
        verification, "verify_program", lambda program, **kw: verified.append(program) or run(program, **kw)
    )
    assert autopar.verify(model, devices=4, cost_model=tight).ok

    def shown(program):
        return [(op.name, op.exponents, op.inputs, op.outputs) for op in program.ops], program.graph.inputs

    assert shown(verified[0]) == shown(printed.program)


def test_a_model_that_drops_in_training_verifies_its_sharding_with_dropout_as_the_identity():
    """A GPT whose Dropouts train (ratio 0.1, training mode true): onnxruntime drew a mask of its own on every rank
    and in the reference ('rank 2 disagrees with its replicas', an internal error). The ranks and the reference now
    run Dropout as inference does, the identity, so the check proves the sharding, forward and backward; the
    trainer draws the masks alike on every rank (`autopar.torch.dropout`)."""
    from models.transformer import build_transformer
    from tests.conftest import profile

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=8, dropout=0.1)
    free = autopar.plan(model, devices=8, cost_model=profile())
    plan = autopar.plan(model, devices=8, cost_model=profile(capacity=0.3 * free.memory_per_device))
    strategies = plan.strategies
    assert strategies["layer0.attn.dropout"][0] == (2, 4, 1, 1)  # batch and heads split
    assert strategies["layer0.mlp.dropout"][0] == (2, 2, 2)  # batch, sequence and hidden split
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report


def test_a_training_step_through_float16_verifies_against_the_rounding_reference(tmp_path):
    """The step runs in float64; onnxruntime rounds where the model casts to float16, and the outputs compare
    within that rounding (they differed by 3.5e-4 relative where 1e-4 was asked, on every plan)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Cast", ["h"], ["h16"], name="down", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h16"], ["y"], name="up", to=TensorProto.FLOAT),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    path = tmp_path / "cast.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "cast", [x], [y], [weight]), opset_imports=[
        helper.make_opsetid("", 17)], ir_version=8), path)  # fmt: skip
    for devices in (1, 2):
        report = autopar.verify(str(path), devices=devices, gradients=True)
        assert report.ok, report.problems
