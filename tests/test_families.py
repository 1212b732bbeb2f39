"""Every model family kept in tests/data plans at 8 and 64 devices and trains on 8 torch.distributed processes.

The exports are modules this project did not write (tests/data/make_exports.py, bench/hf_exports.py).
At their small sizes the default profile keeps every operator whole: one collective's latency
outweighs a layer's compute, so the plan has nothing to check on 8 processes. The training runs
plan them under the simple profile with a slow peak, where splitting pays: tensor and data
parallelism, with collectives forward, backward and in the gradient synchronisation. Each plan then
runs as ``autopar verify FILE --plan PLAN --runtime torch`` runs it: one process per rank, every
collective carried out by torch.distributed (gloo), every parameter's gradient reassembled from its
shards and compared with one device's.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

import autopar
from autopar.graph import load_model
from models.moe import build_moe
from tests.conftest import profile

DATA = Path(__file__).resolve().parent / "data"
FAMILIES = {
    "albert": "hf_albert_dynamo",  # one set of layer weights every layer reads
    "t5": "hf_t5_legacy",  # encoder-decoder: every decoder layer reads the encoder's output
    "swin": "hf_swin_legacy",  # window attention, pads computed from shapes
    "qwen3": "hf_qwen3_dynamo",  # grouped-query attention, rotary tables
    "bloom": "hf_bloom_dynamo",  # ALiBi biases
    "gpt_neox": "hf_gpt_neox_dynamo",  # attention and MLP in parallel off one residual stream
    "olmoe": "hf_olmoe_dynamo",  # mixture of experts: expert weights taken per routed token by GatherND
    "mixtral": "hf_mixtral_dynamo",  # the same experts exported unoptimised: identity Transposes, torch.split
    "mamba2": "hf_mamba2_dynamo",  # a state-space scan in chunks; a per-head parameter no split divides
}
SPLITTING_PAYS = profile(peak=1e9)
MOE_EXPERTS = ("experts.up", "experts.gate", "experts.down")


@pytest.mark.parametrize("devices", [8, 64])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_plans_at_8_and_64_devices(family, devices):
    graph = load_model(DATA / f"{FAMILIES[family]}.onnx")
    plan = autopar.plan(graph, devices=devices)
    assert set(plan.strategies) == {op.name for op in graph.ops}
    assert not plan.fallback_ops


def _trains_on_8_processes(model, plan, trained: int) -> None:
    report = autopar.verify(model, plan, runtime="torch")
    assert report.ok, report.problems
    assert report.runtime == "torch" and report.processes == 8
    executed = report.collectives["executed"]
    assert executed == report.collectives["planned"]
    assert all(executed[phase] for phase in ("forward", "backward", "sync")), executed
    assert report.gradients is not None and report.gradients.ok
    assert report.gradients.checked == trained


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_on_8_processes(family):
    pytest.importorskip("torch")
    path = DATA / f"{FAMILIES[family]}.onnx"
    plan = autopar.plan(path, devices=8, cost_model=SPLITTING_PAYS)
    _trains_on_8_processes(path, plan, sum(p.trainable for p in load_model(path).parameters))


def test_a_qwen3_export_whose_mask_was_left_unfolded_runs_over_micro_batches_as_the_whole_batch(tmp_path):
    """Qwen3 at 512 tokens: its mask too large for the exporter to fold, the file stores the position tables its
    comparisons read at the export's batch of 2 (any other batch was refused: 'Incompatible dimensions'). Two
    stages over two micro-batches of one sample each run on 2 virtual devices as one device runs the whole batch,
    every gradient checked."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.hf_families import FAMILIES as HF_FAMILIES
    from tests.hf_families import VOCAB, export

    torch.manual_seed(0)
    module = HF_FAMILIES["qwen3"].build(2)
    ids = torch.randint(0, VOCAB, (2, 512))
    path = str(tmp_path / "qwen3_512.onnx")
    export(module, (ids, ids), path)
    tables = [t for t in onnx.load(path).graph.initializer if len(t.dims) == 4 and t.dims[0] == 2]
    assert tables and all(t.data_type == onnx.TensorProto.INT64 for t in tables)  # the positions, not the mask
    plan = autopar.plan(path, devices=2, pipeline_stages=2, micro_batches=2)
    assert plan.file.pipeline is not None and plan.file.pipeline.micro_batches == 2
    report = autopar.verify(path, plan, gradients=True)
    assert report.ok, report.problems
    assert report.gradients is not None and report.gradients.ok


def test_the_mixture_of_experts_trains_on_8_processes_one_expert_each():
    pytest.importorskip("torch")
    model = build_moe(layers=1)
    fixed = {f"layers.0.mlp.{name}": ((8, 1, 1), (8, 1, 1)) for name in MOE_EXPERTS}
    plan = autopar.plan(model, devices=8, fixed=fixed, cost_model=SPLITTING_PAYS)
    _trains_on_8_processes(model, plan, sum(p.trainable for p in load_model(model).parameters))
