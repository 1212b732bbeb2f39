"""The training step runs: forward, backward and gradient sync, on virtual ranks and on torch.distributed.

Every trainable parameter's gradient, reassembled from its shards, must equal torch autograd's
on one device; the collectives executed must equal the plan's, phase by phase; a plan whose
backward is broken is caught by name.
"""

from __future__ import annotations

import json
import random

import onnx
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.lowering import Plan
from autopar.search.driver import SearchResult
from models.resnet50 import build_resnet50
from models.transformer import build_transformer
from tests.conftest import run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

MEGATRON_DEVICES = 8


@pytest.fixture(scope="module")
def tiny_resnet():
    return build_resnet50(batch=8, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1))


@pytest.fixture(scope="module")
def megatron_strategies():
    """A 2-layer GPT at hidden 8192 and batch 1 plans tensor parallel (Megatron); the same splits run small."""
    big = build_transformer(kind="gpt", layers=2, hidden=8192, heads=64, seq=512, vocab=1024, batch=1)
    return autopar.plan(big, devices=MEGATRON_DEVICES).strategies


def small_gpt(layers: int = 2):
    return build_transformer(kind="gpt", layers=layers, hidden=64, heads=8, seq=16, vocab=64, batch=1, weights="random")


def _plan(model, strategies, devices: int = 8) -> Plan:
    problem = autopar.build(model, devices)
    choice = tuple(problem.choice_for(strategies))
    return Plan(problem, choice, SearchResult(choice, "given", 0.0), "model", "given", "ascend910", "mixed")


@pytest.mark.parametrize("mode", ["auto_parallel", "data_parallel"])
def test_plan_gradients_verify_on_virtual_devices(tiny_resnet, mode):
    plan = autopar.plan(tiny_resnet, devices=8, mode=mode)
    report = autopar.verify(tiny_resnet, plan, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.ok
    trainable = [p for p in plan.problem.graph.parameters if p.trainable]
    assert report.gradients.checked == len(trainable)
    executed, planned = report.collectives["executed"], report.collectives["planned"]
    assert executed == planned
    if mode == "data_parallel":  # every weight's gradient is summed over all 8 devices
        assert executed["sync"]["AllReduce over 8"]["count"] == len(trainable)
        assert not executed["backward"]


@pytest.mark.parametrize("name", ["tiny_resnet", "gpt_2_layers", "torch_gpt"])
def test_random_candidate_assignments_train_correctly(name, tiny_resnet):
    models = {"tiny_resnet": tiny_resnet, "gpt_2_layers": small_gpt(), "torch_gpt": "tests/data/torch_gpt_dynamo.onnx"}
    model = models[name]
    candidates = autopar.candidates(model, devices=8)
    rng = random.Random(sum(map(ord, name)))
    phases: set[str] = set()
    for draw in range(20):
        strategies = {op: rng.choice(options) for op, options in candidates.items()}
        report = autopar.verify(model, strategies, devices=8, seed=draw, gradients=True)
        assert report.ok, (draw, report.problems)
        assert report.collectives["executed"] == report.collectives["planned"]
        phases |= {phase for phase, entries in report.collectives["executed"].items() if entries}
    assert phases == {"forward", "backward", "sync"}


def test_megatron_gpt_trains_with_the_backward_reduce_scatter_where_the_plan_lists_it(megatron_strategies):
    model = small_gpt()
    plan = _plan(model, megatron_strategies)
    scattered = sorted(
        (entry.consumer, entry.tensor)
        for entry in plan.file.gradients
        if [(step.collective, step.group_size) for step in entry.steps] == [("ReduceScatter", MEGATRON_DEVICES)]
    )
    # Megatron's f under sequence parallelism: the block input, split by sequence, is gathered whole for
    # the column-split projections; their gradients come back partial and are reduce-scattered, q's, k's
    # and v's added up first at the fork they read (`autopar.ops.fork`) and reduce-scattered once
    consumers = {consumer for consumer, _ in scattered}
    for layer in range(2):
        assert {f"layer{layer}.ln1.fork", f"layer{layer}.mlp.fc1"} <= consumers, layer
        assert not {f"layer{layer}.attn.{name}" for name in "qkv"} & consumers, layer
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    backward = report.collectives["executed"]["backward"]
    assert backward == report.collectives["planned"]["backward"]
    assert backward[f"ReduceScatter over {MEGATRON_DEVICES}"]["count"] == len(scattered)


def test_megatron_gpt_on_eight_processes(megatron_strategies):
    model = small_gpt()
    report = autopar.verify(model, _plan(model, megatron_strategies), runtime="torch")
    assert report.ok, report.problems
    assert report.runtime == "torch" and report.processes == 8
    assert report.gradients is not None and report.gradients.ok and report.gradients.checked > 0
    assert report.collectives["executed"] == report.collectives["planned"]


def test_tiny_resnet_on_four_processes(tiny_resnet):
    plan = autopar.plan(tiny_resnet, devices=4, mode="data_parallel")
    report = autopar.verify(tiny_resnet, plan, runtime="torch")
    assert report.ok, report.problems
    assert report.processes == 4
    assert report.collectives["executed"]["sync"]


def _without(data: dict, section: str, index: int) -> dict:
    broken = json.loads(json.dumps(data))
    del broken[section][index]
    return broken


@pytest.mark.parametrize("runtime", ["virtual", "torch"])
def test_a_removed_backward_collective_is_caught_by_name(megatron_strategies, runtime):
    model = small_gpt()
    data = _plan(model, megatron_strategies).to_dict()
    index = next(i for i, entry in enumerate(data["gradients"]) if entry["consumer"] == "layer0.mlp.fc1")
    tensor = data["gradients"][index]["tensor"]
    report = autopar.verify(model, _without(data, "gradients", index), devices=8, gradients=True, runtime=runtime)
    assert not report.ok
    assert f"gradient of {tensor!r} from 'layer0.mlp.fc1'" in report.problems[0]
    assert "missing or wrong" in report.problems[0]


def test_a_removed_gradient_sync_is_caught_by_name(tiny_resnet):
    data = autopar.plan(tiny_resnet, devices=8, mode="data_parallel").to_dict()
    index = next(i for i, entry in enumerate(data["gradient_sync"]) if entry["collective"])
    name = data["gradient_sync"][index]["parameter"]
    report = autopar.verify(tiny_resnet, _without(data, "gradient_sync", index), devices=8, gradients=True)
    assert not report.ok
    assert f"gradient synchronisation of parameter {name!r}" in report.problems[0]
    # it failed before the gradients were compared: still headed as the training step it checked
    assert report.gradients is None and report.training
    assert report.table().splitlines()[0].endswith(": forward, backward and gradient sync")


def test_a_wrong_gradient_value_is_caught(monkeypatch, tiny_resnet):
    from autopar.runtime import program

    real = program.TrainingStep._send_back

    def doubles_fc_weight(self, node, slot, name, source, buffers):
        if name == "fc.weight":
            buffers = [2 * buffer for buffer in buffers]
        return real(self, node, slot, name, source, buffers)

    monkeypatch.setattr(program.TrainingStep, "_send_back", doubles_fc_weight)
    report = autopar.verify(tiny_resnet, autopar.plan(tiny_resnet, devices=4), gradients=True)
    assert not report.ok
    assert report.problems == [report.problems[0]]
    assert report.problems[0].startswith("the gradient of 'fc.weight' differs from the single-device gradient")


def test_forward_only_verification_is_unchanged_by_gradient_entries(tiny_resnet):
    plan = autopar.plan(tiny_resnet, devices=8)
    report = autopar.verify(tiny_resnet, plan)
    assert report.ok and report.gradients is None and not report.training
    assert report.table().splitlines()[0].endswith(": forward")
    assert not report.collectives["executed"]["backward"] and not report.collectives["planned"]["backward"]


def test_cli_verify_gradients_json(tmp_path, capsys, tiny_resnet):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_resnet, path)
    code, out, _ = run_cli(capsys, "verify", str(path), "--devices", "4", "--gradients", "--format", "json")
    assert code == 0
    report = json.loads(out)
    assert {"ok", "runtime", "processes", "outputs", "gradients", "collectives", "time_s"} <= set(report)
    assert report["runtime"] == "virtual" and report["gradients"]["checked"] > 0
    assert set(report["gradients"]) >= {"checked", "max_abs_error", "max_rel_error", "worst"}
    assert set(report["collectives"]) == {"executed", "planned"}


def test_cli_verify_torch_runtime_table(tmp_path, capsys, tiny_resnet):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_resnet, path)
    code, out, _ = run_cli(capsys, "verify", str(path), "--devices", "4", "--runtime", "torch")
    assert code == 0, out
    assert out.startswith("autopar verify: VERIFIED on 4 torch.distributed processes (")
    assert "): forward, backward and gradient sync" in out.splitlines()[0]
    assert "sync" in out


def test_a_taken_port_is_one_sentence(tmp_path, capsys, tiny_resnet):
    import socket

    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_resnet, path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["verify", str(path), "--devices", "4", "--runtime", "torch", "--port", str(port)]
        code, out, err = run_cli(capsys, *argv)
    assert code == 1 and out == ""
    assert f"Port {port} on 127.0.0.1 is taken" in err and "Traceback" not in err


def test_a_dying_rank_is_reported_and_nothing_hangs(monkeypatch, tiny_resnet):
    from autopar.runtime import program

    real = program.run_local

    def dies_on_rank_two(rule, candidate, rank, inputs, output_shapes):
        if rank == 2 and rule.op.op_type == "Conv":
            raise MemoryError("simulated")
        return real(rule, candidate, rank, inputs, output_shapes)

    monkeypatch.setattr(program, "run_local", dies_on_rank_two)
    with pytest.raises(AutoparError, match=r"Rank 2 of the torch runtime died: MemoryError: simulated"):
        autopar.verify(tiny_resnet, autopar.plan(tiny_resnet, devices=4), runtime="torch", timeout_s=30)


def test_without_torch_the_sentence_says_how_to_install(monkeypatch, tiny_resnet):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(AutoparError, match=r"pip install 'autopar\[torch\]'"):
        autopar.verify(tiny_resnet, devices=4, runtime="torch")


def _partial_max_model():
    from onnx import TensorProto, helper

    from tests.conftest import make_model, weight

    nodes = [
        helper.make_node("Mul", ["X", "D"], ["XD"], name="scale"),
        helper.make_node("ReduceMax", ["XD"], ["Y"], name="rmax", axes=[1], keepdims=0),
        helper.make_node("Mul", ["Y", "Y"], ["Z"], name="square"),
    ]
    return make_model(nodes, [("D", TensorProto.FLOAT, [8, 16])], ["Z"], [weight("X", [8, 16], 1)])


def test_a_partial_maximum_sends_its_gradient_to_the_ranks_holding_it():
    # the reduced axis split 4 ways: each rank's local maximum is partial; an AllReduce(max) completes it
    strategies = {"scale": ((1, 1), (1, 1)), "rmax": ((1, 4),), "square": ((1,), (1,))}
    report = autopar.verify(_partial_max_model(), strategies, devices=4, gradients=True)
    assert report.ok, report.problems
    assert report.collectives["executed"]["forward"]["AllReduce over 4"]["count"] == 2


def test_a_partial_maximum_completed_by_a_reduce_scatter_gathers_it_back_for_the_backward():
    # the consumer splits the rows: a ReduceScatter(max) leaves each rank a quarter of the maximum, and
    # the plan lists the AllGather that brings the whole maximum back for the backward
    model = _partial_max_model()
    strategies = {"scale": ((1, 1), (1, 1)), "rmax": ((1, 4),), "square": ((4,), (4,))}
    plan = _plan(model, strategies, devices=4)
    (entry,) = [entry for entry in plan.file.gradients if entry.carries == "max"]
    assert (entry.tensor, entry.producer) == ("Y", "rmax")
    assert [step.collective for step in entry.steps] == ["AllGather"]
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    assert report.collectives["executed"]["backward"]["AllGather over 4"]["count"] >= 1
    data = plan.to_dict()
    data["gradients"] = [e for e in data["gradients"] if e.get("carries") != "max"]
    broken = autopar.verify(model, data, devices=4, gradients=True)
    assert (
        broken.problems[0]
        == "the plan lists no collectives that bring the whole max 'Y' back to 'rmax' for its backward"
    )


def test_a_training_check_too_large_for_this_machine_is_refused_before_any_work(capsys):
    # the forward alone verifies at batch 32; the training step would hold about 39 GB
    code, out, err = run_cli(capsys, "verify", "models/resnet50.onnx", "--devices", "8", "--batch", "32", "--gradients")
    assert code == 1 and out == ""
    assert "Checking the training step of 'resnet50' on 8 devices would hold about" in err
    assert "verify at a smaller batch, or the forward alone" in err and "Traceback" not in err


def test_a_rank_reports_the_error_a_pipeline_stage_raised_not_torchs_wrapper():
    """torch's pipeline stages wrap what a stage's forward raised in "[Stage 0] failed to run forward", which says
    nothing of it: the rank's report is the error underneath, in its own words."""
    pytest.importorskip("torch")
    from autopar.runtime.launch import RuntimeFailure, run_workers

    def work(rank: int, world: int, device: object) -> None:
        try:
            raise AutoparError("Constant 'buffer' of the plan's model has no stored value.")
        except AutoparError as error:
            raise RuntimeError("\n  [Stage 0] failed to run forward:\n  args: ()\n") from error

    with pytest.raises(RuntimeFailure, match="AutoparError: Constant 'buffer' of the plan's model has no stored"):
        run_workers(2, work, timeout_s=60)
