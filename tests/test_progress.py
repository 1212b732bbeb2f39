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


@pytest.fixture
def tiny_model(tmp_path):
    import onnx

    from tests.conftest import two_matmul_chain

    path = tmp_path / "chain.onnx"
    onnx.save(two_matmul_chain(), str(path))
    return str(path)


@pytest.fixture
def shown(monkeypatch):
    """Progress forced on a non-terminal stderr with no delay, as a log would ask (AUTOPAR_PROGRESS=1)."""
    monkeypatch.setenv("AUTOPAR_PROGRESS", "1")
    monkeypatch.setattr(ProgressLine, "DELAY_S", 0.0)


@pytest.mark.parametrize(
    ("argv", "phase"),
    [
        (["verify", "{model}", "--devices", "4", "--gradients"], "autopar: verify backward"),
        (["verify", "{model}", "--devices", "4"], "autopar: verify forward"),
        (["report", "{model}", "--devices", "4", "-o", "{out}"], "autopar: comparisons"),
    ],
)
@pytest.mark.parametrize("quiet", [False, True])
def test_verify_and_report_show_progress_unless_quiet(capsys, shown, tiny_model, tmp_path, argv, phase, quiet):
    from autopar.cli import main

    args = [a.format(model=tiny_model, out=tmp_path / "page.html") for a in argv] + (["--quiet"] if quiet else [])
    assert main(args) == 0
    err = capsys.readouterr().err
    if quiet:
        assert "autopar: verify" not in err and "autopar: comparisons" not in err and "%|" not in err
    else:
        unit = "operators" if "verify" in phase else "plans"
        assert phase in err and unit in err, err


def test_every_phase_the_core_reports_names_its_unit():
    from autopar.progress import UNITS

    phases = []
    with progress.listening(lambda phase, done, total: phases.append(phase)):
        autopar.api.comparison(autopar.plan(MODEL, devices=8))
    assert set(phases) <= set(UNITS) and "comparisons" in phases


def test_every_command_that_runs_long_takes_quiet():
    from autopar.cli.flags import build_parser

    parser = build_parser()
    for command in ("plan", "verify", "sweep", "report", "inspect"):
        assert parser.parse_args([command, MODEL, "--quiet"]).quiet
    assert parser.parse_args(["export", "plan.json", "--to", "jax", "--quiet"]).quiet
