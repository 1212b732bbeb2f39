"""Progress and accounting: the core reports, the CLI shows one line only when asked and slow."""

from __future__ import annotations

import io
import sys

import pytest

import autopar
from autopar import progress
from autopar.cli.output import ProgressLine
from autopar.lowering import read_plan_file

MODEL = "models/resnet50.onnx"


def test_a_plan_reports_every_phase_to_a_listener():
    phases = []
    with progress.listening(lambda phase, done, total: phases.append(phase)):
        autopar.plan(MODEL, devices=8).to_dict()
    assert {"import", "costing operators", "costing redistributions", "search", "lowering"} <= set(phases)


def test_the_plan_file_accounts_for_the_search():
    search = autopar.plan(MODEL, devices=8).to_dict()["search"]
    assert set(search["phases_s"]) == {"import", "costing", "search", "lowering"}
    assert search["layouts"] > 0 and search["layout_pairs"] >= search["layouts"]
    assert search["candidates_kept"] + search["candidates_dropped"] == search["candidates"]
    # ResNet-50's third stage repeats one bottleneck: found from the structure, solved once
    assert {"first_op": "layer3.1.conv1", "operators": 10, "copies": 5} in search["repeated_blocks"]


def test_a_plan_file_written_before_the_accounting_still_reads():
    data = autopar.plan(MODEL, devices=8).to_dict()
    for key in ("phases_s", "layouts", "layout_pairs", "candidates_kept", "candidates_dropped", "repeated_blocks"):
        data["search"].pop(key)
    assert read_plan_file(data).search.repeated_blocks == []


@pytest.mark.parametrize("enabled", [True, False])
def test_the_progress_line_shows_the_phase_unless_quiet(monkeypatch, enabled):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(ProgressLine, "DELAY_S", 0.0)
    with ProgressLine(enabled=enabled) as line:
        line("costing redistributions", 0, 4)
        line("costing redistributions", 4, 4)
    assert ("autopar: costing redistributions" in stream.getvalue()) == enabled


def test_a_fast_run_shows_no_line(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with ProgressLine(enabled=True) as line:  # the default delay: nothing within two seconds
        line("search", 1, 2)
    assert stream.getvalue() == ""
