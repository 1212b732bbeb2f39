"""The ``dtensor`` export: a module of DTensor placements, run under torchrun where torch is installed."""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cost import load_profile
from autopar.cost.mesh import Mesh
from autopar.export.dtensor import module_text, placements
from autopar.export.logical import tensor_groups
from autopar.layout import Layout
from autopar.lowering.axes import LogicalAxis
from models.transformer import build_transformer
from tests.conftest import RESNET50, reordered

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def run_torchrun(path: Path, devices: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices), "--standalone"]
    return subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=600, env=env, cwd=path.parent, check=False
    )


# --- the mesh mapping --------------------------------------------------------------------------------


def dtensor_shard(groups, layout: Layout, rank: int, dim: int) -> int:
    """DTensor's rule, written out: Shard(d) placements split dimension d left to right over the mesh
    dimensions (the leftmost major), each mesh dimension's coordinate being the number the rank's bits of
    that dimension spell (how the module's rank_grid lays the ranks out)."""
    index = 0
    for (_, bits), placement in zip(groups, placements(layout, groups)):
        if placement == f"Shard({dim})":
            index = index * (1 << len(bits)) + LogicalAxis("g", bits).coordinate(rank)
    return index


def test_placements_on_the_logical_axes():
    profile = load_profile("ascend910")
    assert Mesh.of(profile, 1).axis_names == ("single",)
    axes = (LogicalAxis("data", (2, 1)), LogicalAxis("tensor", (0,)))
    assert placements(Layout(((2, 1), (0,))), tensor_groups(Layout(((2, 1), (0,))), axes)) == ["Shard(0)", "Shard(1)"]
    partial = Layout(((1,), ()), partial=(2, 0))
    groups = tensor_groups(partial, axes)
    assert groups == (("data_b2", (2,)), ("data_b1", (1,)), ("tensor", (0,)))
    assert placements(partial, groups) == ["Partial('sum')", "Shard(0)", "Partial('sum')"]
    assert placements(Layout(((),)), tensor_groups(Layout(((),)), ())) == ["Replicate()"]


def random_axes(rng: random.Random, mesh_bits: int) -> tuple[LogicalAxis, ...]:
    """The bits, highest first, cut into 1..3 runs of consecutive bits or dealt to axes at random."""
    names = ("data", "sequence", "tensor")
    dealt: dict[str, list[int]] = {}
    for bit in range(mesh_bits - 1, -1, -1):
        dealt.setdefault(rng.choice(names), []).append(bit)
    return tuple(sorted((LogicalAxis(n, tuple(b)) for n, b in dealt.items()), key=lambda a: -a.bits[0]))


def test_dtensor_left_to_right_sharding_is_autopar_layout():
    """Over every layout and any logical axes, DTensor's left-to-right rule gives each rank autopar's shard."""
    rng = random.Random(7)
    for _ in range(300):
        mesh_bits = rng.randint(1, 4)
        bits = list(range(mesh_bits))
        rng.shuffle(bits)
        ndim = rng.randint(1, 3)
        dims: list[list[int]] = [[] for _ in range(ndim)]
        partial = []
        for bit in bits:
            where = rng.randint(-1, ndim)
            if where == ndim:
                partial.append(bit)
            elif where >= 0:
                dims[where].append(bit)
        layout = Layout(tuple(tuple(d) for d in dims), tuple(partial))
        axes = random_axes(rng, mesh_bits)
        groups = tensor_groups(layout, axes, ordered=True)
        assert sorted(bit for _, group in groups for bit in group) == list(range(mesh_bits))
        for rank, dim in itertools.product(range(1 << mesh_bits), range(ndim)):
            assert dtensor_shard(groups, layout, rank, dim) == layout.shard_index(rank, dim), (layout, axes, groups)


def test_bits_in_another_order_take_a_cut_or_permuted_mesh():
    axes = (LogicalAxis("data", (2, 1, 0)),)
    assert tensor_groups(Layout(((2, 1), (0,))), axes, ordered=True) == (
        ("data_b2_b1", (2, 1)),
        ("data_b0", (0,)),
    )
    assert tensor_groups(Layout(((0, 2),)), axes, ordered=True) == (
        ("data_b0", (0,)),
        ("data_b1", (1,)),
        ("data_b2", (2,)),
    )
    two = (LogicalAxis("data", (3, 2)), LogicalAxis("tensor", (1, 0)))
    assert [name for name, _ in tensor_groups(Layout(((1, 0, 3, 2),)), two, ordered=True)] == ["tensor", "data"]


# --- the generated module ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_module_compiles_and_names_every_parameter(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    [path] = autopar.export_plan(plan, "dtensor", tmp_path / "placed.py")
    text = path.read_text(encoding="utf-8")
    compile(text, str(path), "exec")
    assert "torchrun --nproc-per-node 8 placed.py" in text
    assert "MESH_DIM_NAMES = ('data',)" in text and "MESH_SHAPE = (8,)" in text and "SHAPES_KNOWN = True" in text
    assert "    'data': (2, 1, 0),\n" in text
    for sync in plan.file.gradient_sync:
        assert f"    {sync.parameter!r}: Spec(" in text
    for op in plan.file.without_forks().ops:
        assert f"    {op.name!r}: Op(" in text
    assert "PARAMETERS['conv1.weight']" in text or "PARAMETERS['embed.tok.weight']" in text


def test_partial_values_are_partial_placements():
    plan = autopar.plan(RESNET50, devices=8, mode="data_parallel")  # the loss's mean comes out partial
    text = module_text(plan.file, plan.problem.graph.model)
    assert "'loss': Spec((), (Partial('sum'),), dims=(), partial=(2, 1, 0)" in text


# --- running it ------------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_torchrun_places_every_parameter(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    [path] = autopar.export_plan(plan, "dtensor", tmp_path / f"{fixture}_dtensor.py")
    result = run_torchrun(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"OK: \d+ parameters and \d+ distinct operator boundaries", result.stdout)


@needs_torch
def test_torchrun_bits_in_another_order(gpt_plan, tmp_path):
    """A cut, permuted mesh places a dimension split by (0, 2); the check catches the wrong order."""
    text = module_text(reordered(gpt_plan), gpt_plan.problem.graph.model)
    good = (
        "'embed.pos.weight': Spec((64, 128), (Shard(0), Shard(1), Shard(0)), dims=((0, 2), (1,)),"
        " mesh=('data_b0', 'data_b1', 'data_b2'))"
    )
    assert good in text and "Partial('max')" in text
    path = tmp_path / "reordered.py"
    path.write_text(text, encoding="utf-8")
    result = run_torchrun(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path.write_text(text.replace(good, good.replace("dims=((0, 2)", "dims=((2, 0)")), encoding="utf-8")
    result = run_torchrun(path, 8)
    assert result.returncode != 0 and "embed.pos.weight: rank" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def data_tensor_plan():
    """A GPT whose plan at 8 devices is data 4 x tensor 2: a two-axis logical mesh."""
    model = build_transformer(kind="gpt", layers=1, hidden=1024, heads=16, seq=256, vocab=4096, batch=8)
    return autopar.plan(model, devices=8)


def test_a_data_by_tensor_plan_names_both_axes(data_tensor_plan):
    text = module_text(data_tensor_plan.file, data_tensor_plan.problem.graph.model)
    assert "MESH_DIM_NAMES = ('data', 'tensor')" in text and "MESH_SHAPE = (4, 2)" in text
    assert "    'data': (2, 1),\n    'tensor': (0,),\n" in text
    assert "LINKS = {'data': 'HCCS+PCIe', 'tensor': 'HCCS'}" in text
    assert "(Replicate(), Shard(1))" in text  # a weight split on the tensor axis alone


@needs_torch
def test_torchrun_on_a_data_by_tensor_mesh(data_tensor_plan, tmp_path):
    [path] = autopar.export_plan(data_tensor_plan, "dtensor", tmp_path / "dp_tp.py")
    result = run_torchrun(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on mesh {'data': 4, 'tensor': 2} match the plan" in result.stdout
    simulated = subprocess.run(
        [sys.executable, str(path), "--simulate"], capture_output=True, text=True, timeout=600, check=False
    )
    assert simulated.returncode == 0, simulated.stderr[-3000:]
    assert "on mesh {'data': 4, 'tensor': 2} match the plan" in simulated.stdout
