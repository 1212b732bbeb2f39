"""The device-count sweep: figures per count, flags for counts that add nothing, table, JSON and HTML."""

from __future__ import annotations

import json
import re

import pytest

import autopar
from tests.conftest import profile, run_cli, two_matmul_chain

RESNET50 = "models/resnet50.onnx"


def test_sweep_figures_agree_with_the_plans():
    model = two_matmul_chain(batch=64, d_in=64, d_hidden=256, d_out=64)
    points = autopar.sweep(model, [1, 2, 4], cost_model=profile())
    assert [p["devices"] for p in points] == [1, 2, 4]
    for point in points:
        plan = autopar.plan(model, devices=point["devices"], cost_model=profile())
        assert point["step_time_s"] == pytest.approx(plan.objective, rel=1e-9)
        assert point["samples_per_s"] == pytest.approx(64 / plan.objective, rel=1e-9)
        assert point["memory_per_device_bytes"] == plan.to_dict()["totals"]["memory_per_device_bytes"]
    first = points[0]["samples_per_s"]
    assert points[0]["scaling_efficiency"] == 1.0
    assert points[2]["scaling_efficiency"] == pytest.approx(points[2]["samples_per_s"] / 4 / first, rel=1e-12)


def test_a_count_no_faster_than_a_smaller_one_is_flagged():
    # a batch of 2 cannot use more than 2 devices for its data; four devices only replicate
    model = two_matmul_chain(batch=2, d_in=4, d_hidden=4, d_out=4)
    points = autopar.sweep(model, [2, 4, 8], cost_model=profile(peak=1e12))
    slower = [p for p in points[1:] if p["step_time_s"] >= points[0]["step_time_s"]]
    assert slower, "a model this small gains nothing from more devices"
    assert all("no faster than on 2 devices" in p["warning"] for p in slower)
    assert "warning" not in points[0]


def test_a_count_where_nothing_fits_is_reported_not_raised():
    points = autopar.sweep(two_matmul_chain(), [1, 2], cost_model=profile(capacity=1.0))
    assert all("Nothing fits" in p["error"] for p in points)


def test_sweep_cli_table_json_and_html(capsys, tmp_path):
    page = tmp_path / "sweep.html"
    code, out, err = run_cli(capsys, "sweep", RESNET50, "--devices", "1,8", "--quiet", "-o", page)
    assert code == 0, err
    assert re.search(r"^\s+8\s+16\.\d{3}\s", out, re.MULTILINE)
    text = page.read_text()
    assert text.count("<svg") == 2 and "<table>" in text
    assert not re.search(r"(src|href)=['\"]?https?:", text)  # self-contained: nothing fetched
    code, out, _ = run_cli(capsys, "sweep", RESNET50, "--devices", "1,8", "--quiet", "--format", "json")
    points = json.loads(out)
    assert [p["devices"] for p in points] == [1, 8] and 0 < points[1]["mfu"] < 1
    code, _, err = run_cli(capsys, "sweep", RESNET50, "--devices", "1,6")
    assert code == 2 and "power of two" in err
