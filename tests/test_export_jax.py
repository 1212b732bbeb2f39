"""The ``jax`` export: a module with the plan's Mesh and PartitionSpecs, run where jax is installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.export.jax import module_text, partition_spec, unreduced_axes
from autopar.export.logical import tensor_groups
from autopar.layout import Layout
from autopar.lowering.axes import LogicalAxis
from models.transformer import build_transformer
from tests.conftest import RESNET50, reordered

HAS_JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")


def run_module(path: Path, devices: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env, cwd=path.parent, check=False
    )


def test_partition_specs_name_the_logical_axes_major_first():
    axes = (LogicalAxis("data", (3, 2)), LogicalAxis("tensor", (1, 0)))

    def spec(layout: Layout) -> str:
        return partition_spec(layout, tensor_groups(layout, axes))

    assert spec(Layout(((3, 2), (1, 0), ()))) == "P('data', 'tensor', None)"
    assert spec(Layout(((1, 0, 3, 2),))) == "P(('tensor', 'data'))"  # the tensor axis major
    assert spec(Layout(((3, 2, 1),))) == "P(('data', 'tensor_b1'))"  # part of an axis: a cut mesh
    assert spec(Layout(())) == "P()"
    partial = Layout(((1, 0),), partial=(3, 2), partial_op="max")
    groups = tensor_groups(partial, axes)
    assert partition_spec(partial, groups) == "P('tensor')" and unreduced_axes(partial, groups) == ("data",)


def test_a_one_device_plan_exports_every_tensor_whole(tmp_path):
    plan = autopar.plan(RESNET50, devices=1, batch=2)  # no mesh bit: one empty mesh dimension
    [path] = autopar.export_plan(plan, "jax", tmp_path / "one.py")
    text = path.read_text(encoding="utf-8")
    compile(text, str(path), "exec")
    assert "'conv1.weight': Spec((64, 3, 7, 7), P(None, None, None, None)," in text and "P('" not in text
    assert "on 1 device." in text


@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_module_compiles_and_names_every_parameter(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    [path] = autopar.export_plan(plan, "jax", tmp_path / "sharded.py")
    text = path.read_text(encoding="utf-8")
    compile(text, str(path), "exec")
    assert "xla_force_host_platform_device_count=8 python sharded.py" in text
    assert "AXIS_NAMES = ('data',)" in text and "MESH_SHAPE = (8,)" in text and "SHAPES_KNOWN = True" in text
    for sync in plan.file.gradient_sync:
        assert f"    {sync.parameter!r}: Spec(" in text
    for op in plan.file.without_forks().ops:
        assert f"    {op.name!r}: Op(" in text


def test_partial_values_are_listed_as_unreduced():
    plan = autopar.plan(RESNET50, devices=8, mode="data_parallel")  # the loss's mean comes out partial
    text = module_text(plan.file, plan.problem.graph.model)
    assert "'loss': Spec((), P(), dims=(), unreduced=('data',), reduce_op='sum')" in text
    assert "    ('loss.mean', 'loss'): ('sum', ('data',))," in text
    assert "'images': Spec((256, 3, 224, 224), P('data', None, None, None)" in text


@needs_jax
@pytest.mark.parametrize("fixture", ["resnet_plan", "gpt_plan"])
def test_module_places_every_parameter(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    [path] = autopar.export_plan(plan, "jax", tmp_path / f"{fixture}_jax.py")
    result = run_module(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"OK: \d+ parameters and \d+ distinct operator boundaries", result.stdout)


@needs_jax
def test_module_bits_in_another_order(gpt_plan, tmp_path):
    """A dimension split by (0, 2) cuts the data axis; the check catches the wrong order, and too few devices."""
    text = module_text(reordered(gpt_plan), gpt_plan.problem.graph.model)
    good = (
        "'embed.pos.weight': Spec((64, 128), P(('data_b0', 'data_b2'), 'data_b1'), dims=((0, 2), (1,)),"
        " mesh=('data_b2', 'data_b1', 'data_b0'))"
    )
    assert good in text and "('layer0.ln1', 'layer0.ln1'): ('max', ('data_b2',))" in text
    path = tmp_path / "reordered.py"
    path.write_text(text, encoding="utf-8")
    result = run_module(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = run_module(path, 4)
    assert result.returncode != 0 and "xla_force_host_platform_device_count=8" in result.stderr
    path.write_text(text.replace(good, good.replace("dims=((0, 2)", "dims=((2, 0)")), encoding="utf-8")
    result = run_module(path, 8)
    assert result.returncode != 0 and "embed.pos.weight: device" in result.stderr


@needs_jax
def test_module_on_a_data_by_tensor_mesh(tmp_path):
    model = build_transformer(kind="gpt", layers=1, hidden=1024, heads=16, seq=256, vocab=4096, batch=8)
    plan = autopar.plan(model, devices=8)
    [path] = autopar.export_plan(plan, "jax", tmp_path / "dp_tp.py")
    text = path.read_text(encoding="utf-8")
    assert "AXIS_NAMES = ('data', 'tensor')" in text and "MESH_SHAPE = (4, 2)" in text
    result = run_module(path, 8)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on mesh {'data': 4, 'tensor': 2} match the plan" in result.stdout
