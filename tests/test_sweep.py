"""The device-count sweep: figures per count, flags for counts that add nothing, table, JSON and HTML."""

from __future__ import annotations

import html
import json
import re

import pytest

import autopar
from autopar.report.sweep import REPEATS, log_ticks, short_number, sweep_html
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
    assert "no faster" not in points[0].get("warning", "")  # it may repeat work, it is not slower


def test_a_count_where_nothing_fits_is_reported_not_raised():
    points = autopar.sweep(two_matmul_chain(), [1, 2], cost_model=profile(capacity=1.0))
    assert all("Nothing fits" in p["error"] for p in points)


def test_sweep_cli_table_json_and_html(capsys, tmp_path):
    page = tmp_path / "sweep.html"
    code, out, err = run_cli(capsys, "sweep", RESNET50, "--devices", "1,8", "--quiet", "-o", page)
    assert code == 0, err
    assert re.search(r"^\s+8\s+256\s+16\.\d{3}\s", out, re.MULTILINE)  # devices, global batch, step ms
    text = page.read_text()
    assert text.count("<svg") == 3 and "<table>" in text
    assert not re.search(r"(src|href)=['\"]?https?:", text)  # self-contained: nothing fetched
    code, out, _ = run_cli(capsys, "sweep", RESNET50, "--devices", "1,8", "--quiet", "--format", "json")
    points = json.loads(out)
    assert [p["devices"] for p in points] == [1, 8] and 0 < points[1]["mfu"] < 1
    code, _, err = run_cli(capsys, "sweep", RESNET50, "--devices", "1,6")
    assert code == 2 and "power of two" in err


def test_per_device_batch_grows_the_global_batch_with_the_devices():
    model = two_matmul_chain(batch=4, d_in=64, d_hidden=256, d_out=64)
    points = autopar.sweep(model, [1, 2, 4], cost_model=profile(), per_device_batch=8)
    assert [p["global_batch"] for p in points] == [8, 16, 32]
    for point in points:
        plan = autopar.plan(model, devices=point["devices"], cost_model=profile(), batch=point["global_batch"])
        assert point["step_time_s"] == pytest.approx(plan.objective, rel=1e-9)
        assert point["samples_per_s"] == pytest.approx(point["global_batch"] / plan.objective, rel=1e-9)
    assert points.per_device_batch == 8 and "weak scaling: 8 samples a device" in points.html()
    strong = autopar.sweep(model, [1, 2], cost_model=profile())
    assert [p["global_batch"] for p in strong] == [4, 4] and "strong scaling" in strong.html()


def test_per_device_batch_refuses_a_batch_too():
    with pytest.raises(autopar.AutoparError, match=r"either batch .* or per_device_batch"):
        autopar.sweep(two_matmul_chain(), [1, 2], batch=8, per_device_batch=4)


def test_counts_where_devices_repeat_work_are_flagged():
    # a batch of 2 over 8 devices: at most 2 distinct shards of the data; the rest repeat them
    model = two_matmul_chain(batch=2, d_in=4, d_hidden=4, d_out=4)
    points = autopar.sweep(model, [1, 8], cost_model=profile(peak=1e12))
    assert points[0]["replicated"] == 1 and points[1]["replicated"] > 1
    assert "warning" in points[1]
    table = str(points)
    assert re.search(rf"^\s+8\s.*\s{points[1]['replicated']} times\s", table, re.MULTILINE)
    assert "devices repeat work" in points[1]["warning"]
    page = html.unescape(points.html())
    assert page.count(f"stroke='{REPEATS}'") == 3  # one hollow point on each of the three charts
    assert "Hollow red points: devices repeat one another's work (8 devices)" in page


def _texts(svg: str) -> list[tuple[float, str]]:
    return [(float(x), text) for x, text in re.findall(r"<text x='([\d.]+)'[^>]*>([^<]*)</text>", svg)]


def test_the_charts_read_at_a_thousand_devices():
    """Log-2 devices, every tick labelled in short numbers, nothing past the edges, titles beside the ticks."""
    points = [
        {
            "devices": 1 << k,
            "global_batch": 256 << k,
            "replicated": 1,
            "step_time_s": 0.12 * (1 + k / 40),
            "samples_per_s": 2118.0 * (1 << k) / (1 + k / 40),
            "scaling_efficiency": 1 / (1 + k / 40),
            "mfu": 0.2 / (1 + k / 40),
            "memory_per_device_bytes": 11.1e9,
            "memory_plan": {},
            "warnings": [],
        }
        for k in range(11)
    ]
    page = sweep_html("resnet50", points, 256)
    svgs = re.findall(r"<svg.*?</svg>", page)
    assert len(svgs) == 3
    for svg in svgs:
        width = float(re.search(r"width='(\d+)'", svg).group(1))
        texts = _texts(svg)
        assert all(0 <= x <= width for x, _ in texts)
        ticks = [text for _, text in texts]
        assert [str(f"{1 << k:,}") for k in range(11)] == [t for t in ticks if t.replace(",", "").isdigit()][-11:]
        assert "devices (log 2 scale)" in ticks
        # the y title is rotated at the far left, left of every tick label's right end (anchored at left - 8)
        assert "rotate(-90)" in svg and "translate(16 " in svg
    throughput = _texts(svgs[0])
    assert [t for _, t in throughput if t.endswith(("k", "M"))] == ["1k", "10k", "100k", "1M", "10M"]
    assert not re.search(r"\d,\d{3},\d{3}/s", page)  # no long labels to clip
    assert "samples/s (log scale)" in svgs[0] and "stroke-dasharray" in svgs[0]


def test_short_numbers_and_log_ticks():
    assert short_number(1_192_993) == "1.19M" and short_number(999) == "999" and short_number(2e9) == "2G"
    assert log_ticks(1000, 10_000_000) == [1000, 10000, 100000, 1000000, 10000000]
    assert log_ticks(0.3, 3) == [0.5, 1, 2]


def test_sweep_cli_per_device_batch(capsys):
    code, out, err = run_cli(
        capsys, "sweep", RESNET50, "--devices", "1,2", "--per-device-batch", "4", "--quiet", "--format", "json"
    )
    assert code == 0, err
    points = json.loads(out)
    assert [p["global_batch"] for p in points] == [4, 8] and [p["replicated"] for p in points] == [1, 1]
    code, _, err = run_cli(capsys, "sweep", RESNET50, "--batch", "8", "--per-device-batch", "4")
    assert code == 2 and err.count("\n") == 1 and "give one of them" in err
    code, _, err = run_cli(capsys, "sweep", RESNET50, "--per-device-batch", "0")
    assert code == 2 and "--per-device-batch must be from 1" in err
    code, _, err = run_cli(capsys, "sweep", RESNET50, "--devices", "1024", "--per-device-batch", "65536")
    assert code == 2 and "a global batch over" in err
