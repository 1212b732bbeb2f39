"""A pipelined training step: stages over micro-batches in 1F1B, every gradient and every message checked.

A small GPT (2 layers, hidden 32, sequence 16, batch 8) is cut into stages; each run is compared
with one device running the whole batch (float64), and the messages the ranks ran with the plan's.
A plan with a send removed or two stages swapped is refused in one sentence before anything runs;
a rank whose peer never sends ends at the timeout with a sentence naming what it waited for.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.errors import PlanFileError
from autopar.layout import Layout
from autopar.lowering import read_plan_file
from autopar.lowering.staged import routes, staged_program
from models.transformer import build_transformer
from tests.conftest import run_cli
from tests.pipelines import random_pipelined_plans

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def gpt():
    return build_transformer(kind="gpt", layers=2, hidden=32, heads=4, seq=16, vocab=32, batch=8, weights="random")


@pytest.fixture(scope="module")
def two_stages(gpt):
    return autopar.plan(gpt, devices=8, pipeline_stages=2, micro_batches=4, stage_starts=["layer1.ln1"])


def test_routes_take_each_region_from_the_matching_device_where_it_can():
    split, whole = Layout(((1, 0), ())), Layout(((), ()))
    pieces = routes(split, split, (8, 4), 4)
    assert [(p.sender, p.receiver, p.numel) for p in pieces] == [(r, r, 8) for r in range(4)]
    gathered = routes(split, whole, (8, 4), 4)  # each receiver gathers four quarters, its own first
    assert sorted(p.sender for p in gathered if p.receiver == 2) == [0, 1, 2, 3]
    assert sum(p.numel for p in gathered if p.receiver == 2) == 32
    swapped = routes(Layout(((0,), ())), Layout(((), (0,))), (4, 4), 2)
    assert all(p.numel == 4 for p in swapped) and len(swapped) == 4


def test_two_stages_train_on_virtual_devices(gpt, two_stages):
    report = autopar.verify(gpt, two_stages, gradients=True)
    assert report.ok, report.problems
    trainable = [p for p in two_stages.problem.graph.parameters if p.trainable]
    assert report.gradients is not None and report.gradients.checked == len(trainable) == 37
    executed, planned = report.collectives["executed"], report.collectives["planned"]
    assert executed == planned
    sends = two_stages.file.pipeline.sends
    assert {(s.tensor, s.to_op) for s in sends} == {
        ("layer0.mlp.residual", "layer1.ln1"),
        ("layer0.mlp.residual", "layer1.attn.residual"),
    }
    assert sum(e["count"] for e in executed["send"].values()) > 0
    assert any(label.startswith("backward 1->0") for label in executed["send"])


def test_the_forward_alone_runs_without_gradients(gpt, two_stages):
    report = autopar.verify(gpt, two_stages)
    assert report.ok, report.problems
    assert report.gradients is None
    assert not any(label.startswith("backward") for label in report.collectives["executed"]["send"])


def test_twenty_random_pipelined_assignments_train_correctly(gpt):
    """Random cuts, stage counts (2, 4), micro-batches (1 to 8) and strategies (`tests.pipelines`)."""
    shapes, phases = set(), set()
    plans = random_pipelined_plans(gpt)
    for draw in range(20):
        stages, micro_batches, starts, plan = next(plans)
        report = autopar.verify(gpt, plan, seed=draw, gradients=True)
        assert report.ok, (draw, starts, report.problems)
        assert report.collectives["executed"] == report.collectives["planned"]
        shapes.add((stages, micro_batches))
        phases |= {phase for phase, entries in report.collectives["executed"].items() if entries}
    assert len(shapes) >= 5
    assert phases == {"forward", "backward", "sync", "send"}


def _broken(plan, tmp_path, how: str):
    data = plan.to_dict()
    if how == "removed send":
        data["pipeline"]["sends"] = [s for s in data["pipeline"]["sends"] if s["tensor"] != "layer0.mlp.residual"]
    else:
        stages = data["pipeline"]["stages"]
        stages[0], stages[1] = stages[1], stages[0]
    path = tmp_path / f"{how.replace(' ', '_')}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("removed send", ["sends no 'layer0.mlp.residual' from stage 0 to stage 1", "micro-batch 0"]),
        ("swapped stages", ["Stage 0 reads", "from stage 1", "micro-batch 0", "out of order"]),
    ],
)
def test_a_plan_whose_ranks_would_wait_forever_is_refused(gpt, two_stages, tmp_path, capsys, how, words):
    model = tmp_path / "gpt.onnx"
    model.write_bytes(gpt.SerializeToString())
    code, out, err = run_cli(capsys, "verify", model, "--plan", _broken(two_stages, tmp_path, how), "--gradients")
    assert code == 1 and not out
    assert all(word in err for word in words), err
    assert err.count("\n") == 1  # one sentence, no traceback


def test_staged_program_names_each_crossing_once(gpt, two_stages):
    graph = autopar.api.planning.model_graph(gpt, 2, None)
    cost = two_stages.problem.cost
    staged = staged_program(graph, read_plan_file(two_stages.to_dict()), cost)
    assert [c.index for c in staged.crossings] == list(range(len(two_stages.file.pipeline.sends)))
    assert staged.stages[0].stop == staged.stages[1].start
    data = two_stages.to_dict()
    data["pipeline"]["stages"][1]["first_device"] = 0
    with pytest.raises(PlanFileError, match=r"Stage 1 is on devices 0\.\.3, but stage 1 of 2 runs on devices 4\.\.7"):
        staged_program(graph, read_plan_file(data), cost)


def test_two_stages_train_on_four_torch_processes(gpt):
    plan = autopar.plan(gpt, devices=4, pipeline_stages=2, micro_batches=2, stage_starts=["layer1.ln1"])
    report = autopar.verify(gpt, plan, runtime="torch", timeout_s=60)
    assert report.ok, report.problems
    assert report.processes == 4
    assert report.collectives["executed"] == report.collectives["planned"]


def test_a_rank_whose_peer_never_sends_ends_at_the_timeout_with_a_sentence(gpt, monkeypatch):
    from autopar.runtime.launch import RuntimeFailure
    from autopar.runtime.pipeline import DistributedLinks

    plan = autopar.plan(gpt, devices=4, pipeline_stages=2, micro_batches=2, stage_starts=["layer1.ln1"])
    send = DistributedLinks.send

    def lose_micro_batch_one(self, transfer, tensor):  # the forked ranks inherit it
        if transfer.micro_batch != 1:
            send(self, transfer, tensor)

    monkeypatch.setattr(DistributedLinks, "send", lose_micro_batch_one)
    # stage 1 waits for the activation, stage 0 for its gradient: whichever gives up first names it
    sentence = (
        r"waited 3 s for .*'layer0.mlp.residual' from stage \d \(rank \d\)"
        r" to stage \d \(rank \d\) in micro-batch 1"
    )
    with pytest.raises(RuntimeFailure, match=sentence):
        autopar.verify(gpt, plan, runtime="torch", timeout_s=3)


def test_the_dtensor_export_trains_with_torch_pipelining_under_torchrun(gpt, tmp_path):
    """PipelineStage + Schedule1F1B on 4 gloo processes: the loss equals one device's over the whole batch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from autopar.runtime.single import run_graph
    from autopar.spmd.values import materialise

    fixed = {"layer0.attn.q": [[1, 1, 1], [1, 2]], "layer1.mlp.fc1": [[1, 1, 1], [1, 2]]}  # tensor 2 in each stage
    plan = autopar.plan(gpt, devices=4, pipeline_stages=2, micro_batches=2, stage_starts=["layer1.ln1"], fixed=fixed)
    program, model = autopar.export_plan(plan, "dtensor", tmp_path / "gpt_dtensor.py")
    text = program.read_text()
    assert "Schedule1F1B" in text and "PipelineStage" in text and "'layer0.attn.q.weight': (Shard(1),)" in text
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(program)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("pipelined loss"))
    pipelined = float(line.split()[2])
    graph = autopar.api.planning.model_graph(gpt, None, None)
    values = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in materialise(graph, 0).items()}
    outputs, _ = run_graph(graph, values)
    assert pipelined == pytest.approx(float(outputs["loss"].detach()), rel=1e-9)
    assert done.stdout.strip().endswith("OK")
    assert model.suffix == ".onnx"


def test_the_jax_export_says_it_does_not_express_pipelines(two_stages, tmp_path):
    with pytest.raises(autopar.AutoparError, match=r"^The jax export does not express pipeline stages"):
        autopar.export_plan(two_stages, "jax", tmp_path / "gpt_jax.py")


def test_an_operator_reading_a_sent_tensor_twice_receives_it_twice():
    """Y crosses the cut into Mul(Y, Y): two sends; the output Z (batch first) is joined from the micro-batches."""
    from onnx import TensorProto, helper

    from tests.conftest import make_model, weight

    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["Y"], name="mm1"),
        helper.make_node("Mul", ["Y", "Y"], ["S"], name="square"),
        helper.make_node("MatMul", ["S", "W2"], ["Z"], name="mm2"),
    ]
    model = make_model(
        nodes, [("X", TensorProto.FLOAT, [8, 8])], ["Z"], [weight("W1", [8, 16], 1), weight("W2", [16, 4], 2)]
    )
    plan = autopar.plan(model, devices=4, pipeline_stages=2, micro_batches=2, stage_starts=["square"])
    assert [(s.tensor, s.to_op) for s in plan.file.pipeline.sends] == [("Y", "square"), ("Y", "square")]
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    assert report.collectives["executed"] == report.collectives["planned"]
