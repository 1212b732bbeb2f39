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
from autopar.export.dtensor import mesh_order, module_text, placements
from autopar.layout import Layout
from tests.conftest import reordered

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def run_torchrun(path: Path, devices: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices), "--standalone"]
    return subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=600, env=env, cwd=path.parent, check=False
    )


# --- the mesh mapping --------------------------------------------------------------------------------


def dtensor_shard(order: tuple[int, ...], layout: Layout, rank: int, dim: int) -> int:
    """DTensor's rule, written out: Shard(d) placements split dimension d left to right over the mesh
    dimensions (the leftmost major), each mesh dimension's coordinate being the rank's bit there."""
    index = 0
    for bit, placement in zip(order, placements(layout, order)):
        if placement == f"Shard({dim})":
            index = index * 2 + ((rank >> bit) & 1)
    return index


def test_mesh_dimensions_are_the_bits_highest_first():
    profile = load_profile("ascend910")
    assert Mesh.of(profile, 8).axis_names == ("b2", "b1", "b0")
    assert Mesh.of(profile, 1).axis_names == ("single",)
    assert placements(Layout(((2, 1, 0), ())), (2, 1, 0)) == ["Shard(0)", "Shard(0)", "Shard(0)"]
    assert placements(Layout(((1,), ()), partial=(2, 0)), (2, 1, 0)) == [
        "Partial('sum')",
        "Shard(0)",
        "Partial('sum')",
    ]
    assert placements(Layout(((),)), ()) == ["Replicate()"]


def test_dtensor_left_to_right_sharding_is_autopar_layout():
    """Over every layout's mesh order, DTensor's left-to-right rule gives each rank autopar's shard."""
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
        order = mesh_order(layout, mesh_bits)
        assert sorted(order) == list(range(mesh_bits))
        for rank, dim in itertools.product(range(1 << mesh_bits), range(ndim)):
            assert dtensor_shard(order, layout, rank, dim) == layout.shard_index(rank, dim), (layout, order)


def test_bits_in_another_order_take_a_permuted_mesh():
    assert mesh_order(Layout(((2, 1), (0,))), 3) == (2, 1, 0)
    assert mesh_order(Layout(((0, 2),)), 3) == (0, 1, 2)
    assert mesh_order(Layout(((1, 3), (0, 2))), 4) == (1, 0, 3, 2)


# --- the generated module ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_module_compiles_and_names_every_parameter(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    [path] = autopar.export_plan(plan, "dtensor", tmp_path / "placed.py")
    text = path.read_text(encoding="utf-8")
    compile(text, str(path), "exec")
    assert "torchrun --nproc-per-node 8 placed.py" in text
    assert "MESH_DIM_NAMES = ('b2', 'b1', 'b0')" in text and "SHAPES_KNOWN = True" in text
    for sync in plan.file.gradient_sync:
        assert f"    {sync.parameter!r}: Spec(" in text
    for op in plan.file.ops:
        assert f"    {op.name!r}: Op(" in text
    assert "PARAMETERS['conv1.weight']" in text or "PARAMETERS['embed.tok.weight']" in text


def test_partial_values_are_partial_placements(resnet_plan):
    text = module_text(resnet_plan.file, resnet_plan.problem.graph.model)
    assert "'loss': Spec((), (Partial('sum'), Partial('sum'), Partial('sum')), dims=(), partial=(2, 1, 0)" in text


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
    """A permuted mesh places a dimension split by (0, 2); the check catches the wrong order."""
    text = module_text(reordered(gpt_plan), gpt_plan.problem.graph.model)
    good = (
        "'embed.pos.weight': Spec((64, 128), (Shard(0), Shard(1), Shard(0)), dims=((0, 2), (1,)),"
        " mesh=('b0', 'b1', 'b2'))"
    )
    assert good in text and "Partial('max')" in text
    path = tmp_path / "reordered.py"
    path.write_text(text, encoding="utf-8")
    result = run_torchrun(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path.write_text(text.replace(good, good.replace("dims=((0, 2)", "dims=((2, 0)")), encoding="utf-8")
    result = run_torchrun(path, 8)
    assert result.returncode != 0 and "embed.pos.weight: rank" in result.stdout + result.stderr
