"""The plan report: one self-contained HTML page (CLI ``autopar report`` and a Plan's Jupyter display)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import autopar
from autopar.report.figures import as_plan_file, is_image_model
from autopar.report.html import (
    CSS,
    SECTIONS,
    axis_splits,
    fold_groups,
    plan_html,
    plan_report,
    report_html,
    timeline_phases,
    warnings_of,
)
from models.transformer import build_preset
from tests.conftest import export_gpt, profile, run_cli

RESNET50 = "models/resnet50.onnx"
BALANCED = ("svg", "table", "section", "tr", "td", "th", "div", "thead", "tbody", "ul", "li", "text", "title")
VOID = {"meta", "br", "img", "input", "link", "hr"}


class _Page(HTMLParser):
    """Collects what the tests check and the tags left open or closed out of order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.ids: list[str] = []
        self.headings: list[str] = []
        self.links: list[str] = []
        self.cards: dict[str, str | None] = {}
        self.map_rows: list[dict[str, str | None]] = []
        self.in_map = False
        self.in_h2 = False
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if found.get(key):
                self.links.append(str(found[key]))
        if found.get("id"):
            self.ids.append(str(found["id"]))
        if tag == "div" and found.get("class") == "card":
            self.cards[str(found["data-key"])] = found.get("data-value")
        if tag == "table" and found.get("class") == "map":
            self.in_map = True
        if tag == "tr" and self.in_map and "data-op" in found:
            self.map_rows.append(found)
        if tag == "h2":
            self.in_h2 = True
            self.headings.append("")
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass  # <rect .../>: opens and closes

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.in_map = False
        if tag == "h2":
            self.in_h2 = False
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self.in_h2:
            self.headings[-1] += data


def parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


@pytest.fixture(scope="module")
def resnet():
    plan = autopar.plan(RESNET50, devices=8)
    return plan, plan.to_dict()


@pytest.fixture(scope="module")
def gpt():
    plan = autopar.plan(build_preset("gpt2", layers=2, batch=8), devices=8)
    return plan, plan.to_dict()


@pytest.fixture(scope="module", params=["resnet", "gpt"])
def case(request):
    plan, data = request.getfixturevalue(request.param)
    from autopar.report.html import plan_report

    return plan, data, plan_report(plan, autopar.api.comparison(plan))


def test_the_page_is_well_formed_and_self_contained(case):
    _, _, page = case
    parsed = parse(page)
    assert parsed.problems == []
    assert parsed.stack == [] or parsed.stack == ["html"], parsed.stack  # every element closed
    assert page.startswith("<!doctype html>")
    for tag in ("svg", "table"):
        assert page.count(f"<{tag}") == page.count(f"</{tag}>") > 0
    assert parsed.scripts == 0
    assert all(link.startswith("#") for link in parsed.links), parsed.links
    assert "http" not in "".join(parsed.links) and "url(" not in page
    assert len(page.encode("utf-8")) < 3_000_000


def test_every_section_is_there(case):
    _, _, page = case
    parsed = parse(page)
    assert [i for i in parsed.ids if i in SECTIONS] == [key for key in SECTIONS if key != "schedule"]  # one stage
    assert parsed.headings == [
        "Summary",
        "Strategy map",
        "Device mesh",
        "One step",
        "Costliest operators",
        "Memory per device",
        "Why not data parallel",
        "Collectives",
    ]


def test_the_summary_numbers_are_the_plans(case):
    plan, data, page = case
    cards = parse(page).cards
    totals = data["totals"]
    assert float(cards["step_time_s"]) == totals["step_time_s"] == pytest.approx(plan.objective, rel=1e-9)
    assert float(cards["mfu"]) == totals["ideal_step_time_s"] / totals["step_time_s"]
    assert int(cards["memory_per_device_bytes"]) == totals["memory_per_device_bytes"]
    assert float(cards["speedup_vs_data_parallel"]) == totals["speedup_vs_data_parallel"]
    batch = next(iter(data["context"]["inputs"].values()))[0]
    assert float(cards["samples_per_s"]) == batch / totals["step_time_s"]
    alone = autopar.plan(plan.problem.graph.model, devices=8, mode="stand_alone").to_dict()
    assert float(cards["speedup_vs_stand_alone"]) == pytest.approx(
        alone["totals"]["step_time_s"] / totals["step_time_s"], rel=1e-9
    )


def test_every_operator_is_in_the_strategy_map(case):
    _, data, page = case
    rows = parse(page).map_rows
    names = [op["name"] for op in data["ops"]]
    assert sum(int(str(row["data-count"])) for row in rows) == len(names)
    shown = {str(row["data-op"]) for row in rows}
    folded = {name for row in rows for name in str(row["title"]).partition("copies: ")[2].split(", ") if name}
    assert shown | folded == set(names)
    assert not shown & folded


def test_repeated_blocks_fold_into_one_row_with_a_count(resnet):
    _, data = resnet
    (block,) = data["search"]["repeated_blocks"]
    groups = fold_groups(data)
    first = [op["name"] for op in data["ops"]].index(block["first_op"])
    assert [len(g) for g in groups if g[0] == first] == [block["copies"]]
    assert len(groups) == len(data["ops"]) - block["operators"] * (block["copies"] - 1)
    rows = parse(report_html(data)).map_rows
    assert {str(r["data-op"]): int(str(r["data-count"])) for r in rows}[block["first_op"]] == block["copies"]


def test_axis_kinds_come_from_the_layouts(resnet, gpt):
    _, data = resnet
    ops = {op["name"]: op for op in data["ops"]}
    assert axis_splits(ops["layer1.0.conv1"], image=True) == ({"batch": 8}, 8)
    assert axis_splits(ops["fc"], image=True) == ({"batch": 4, "channels/hidden": 2}, 8)  # ((4,1),(2,1),(2,))
    data_parallel = autopar.plan(RESNET50, devices=8, mode="data_parallel").to_dict()
    mean = next(op for op in data_parallel["ops"] if op["name"] == "loss.mean")
    assert axis_splits(mean, image=True)[0] == {"batch": 8}  # a full reduction keeps its kind
    plan, data = gpt
    ops = {op["name"]: op for op in data["ops"]}
    (rows, hidden), ids = plan.strategies["embed.tok"]  # the table's hidden dim split, its rows and the ids whole
    assert rows == 1 and set(ids) == {1} and hidden > 1
    assert axis_splits(ops["embed.tok"], image=False) == ({"channels/hidden": hidden}, hidden)
    model = build_preset("gpt2", layers=2, batch=8)
    heads = autopar.plan(
        model,
        devices=8,
        mode="semi_auto_parallel",
        fixed={"layer0.attn.scores": ((2, 4, 1, 1), (2, 4, 1, 1)), "layer0.mlp.fc2": ((2, 1, 4), (4, 1))},
    ).to_dict()
    ops = {op["name"]: op for op in heads["ops"]}
    assert axis_splits(ops["layer0.attn.scores"], image=False) == ({"batch": 2, "heads": 4}, 8)  # 12 heads
    assert axis_splits(ops["layer0.mlp.fc2"], image=False) == ({"batch": 2, "contraction": 4}, 8)


def test_the_timeline_adds_up_to_the_step(case):
    plan, data, _ = case
    from autopar.api import compute_split

    forward, recompute = compute_split(plan)
    phases = dict(timeline_phases(data, forward, recompute))
    totals = data["totals"]
    critical = sum(v for k, v in phases.items() if k != "hidden gradient sync")
    assert critical == pytest.approx(totals["step_time_s"], rel=1e-9)
    assert phases["hidden gradient sync"] == totals["hidden_communication_s"]
    assert 0 < phases["forward"] < phases["backward"]  # the backward pays about twice the forward
    assert dict(timeline_phases(data))["compute"] == totals["compute_s"]  # a plan file alone: one phase


def test_why_lists_the_operators_off_data_parallel(gpt):
    plan, data = gpt
    dp = autopar.plan(plan.problem.graph.model, devices=8, mode="data_parallel").to_dict()
    page = report_html(data, data_parallel=dp)
    section = page.split("<section id='why'>")[1].split("</section>")[0]
    reference = {op["name"]: op["strategy"] for op in dp["ops"]}
    differ = [op["name"] for op in data["ops"] if op["strategy"] != reference[op["name"]]]
    assert differ, "GPT-2's plan leaves data parallel somewhere"
    for name in differ:
        assert f"<code>{name}</code>" in section
    assert "data parallel: batch x8" in section
    assert "faster here" in section or "slower here" in section
    groups = re.findall(r"<tr data-group='([^']*)' data-count='(\d+)'>", section)
    assert sum(int(count) for _, count in groups) == len(re.findall(r"<li><code>", section))
    assert len(groups) == len(set(groups)) <= len(differ)  # one row per block and decision


def test_why_groups_gpt2_by_repeated_block_and_decision():
    """GPT-2 at 64 devices, batch 8: some 450 operators off data parallel read as a dozen groups, the layers'
    groups folded on the block's first operator, layer0.ln1 (the plan's repeated block)."""
    model = build_preset("gpt2", batch=8)
    plan = autopar.plan(model, devices=64)
    page = plan_report(plan, autopar.api.comparison(plan))
    section = page.split("<section id='why'>")[1].split("</section>")[0]
    rows = re.findall(r"<tr data-group='([^']*)'", section)
    assert 1 < len(rows) <= 20
    blocks = {row.split("|")[0] for row in rows}
    assert blocks <= {"", "layer0.ln1"} and "layer0.ln1" in blocks
    leaving = re.search(r"(\d+) of 451 operators leave data parallel", section)
    assert leaving and 440 <= int(leaving[1]) <= 451  # all but the loss's few
    assert "each of 12 copies of the block from layer0.ln1" in section


def test_the_mesh_reads_as_levels_at_8_and_1024_devices():
    for devices in (8, 1024):
        page = report_html(autopar.plan(RESNET50, devices=devices).to_dict())
        mesh = page.split("<section id='mesh'>")[1].split("</section>")[0]
        svg = re.search(r"<svg width='(\d+)'.*?</svg>", mesh, re.S)
        assert svg and int(svg.group(1)) <= 1400  # fits a 1400-px window at any count
        assert mesh.count("<rect") < 60  # levels and groups, not one box per device
        assert "groups of 8" in mesh and f"groups of {devices:,}" in mesh
        assert "bit 2: data" in mesh
    assert "replicated 4 x data 128 x tensor 2" in mesh and "&#8230;" in mesh and "128 units of 8" in mesh


def test_the_costliest_operators_are_a_chart(resnet):
    _, data = resnet
    section = report_html(data).split("<section id='costliest'>")[1].split("</section>")[0]
    assert "<svg" in section and section.count("<rect") >= 12 and "compute" in section


def test_styles_are_scoped_and_outrank_a_notebooks():
    """Every rule sits under two classes (a notebook's ``.jp-RenderedHTMLCommon td`` has one), and cells,
    paragraphs and list items are reset to the left."""
    rules = [rule for rule in CSS.split("\n") if rule]
    for rule in rules:
        for selector in rule.split("{")[0].split(","):
            assert selector.startswith(".autopar-report.autopar-scoped"), selector
    assert any("td,.autopar-report.autopar-scoped th" in r and "text-align:left" in r for r in rules)
    assert "tbody tr:nth-child(n)" in CSS  # a notebook's striped rows undone
    assert "<div class='autopar-report autopar-scoped'>" in plan_html(autopar.plan(RESNET50, devices=8))


def test_speed_ups_are_plain_ratios_and_x_is_a_split_factor(resnet):
    _, data = resnet
    page = report_html(data)
    cards = page.split("<section id='summary'>")[1].split("</section>")[0]
    assert not re.search(r"x\d+\.\d", cards)  # a speed-up is written 1.005, never x1.005
    strategy_map = page.split("<section id='strategy-map'>")[1].split("</section>")[0]
    assert not re.search(r"<td class='num'>x\d", strategy_map)  # copies and repeats are counts


def test_collectives_read_as_sentences(resnet):
    _, data = resnet
    page = report_html(data)
    section = page.split("<section id='collectives'>")[1].split("</section>")[0]
    assert (
        "ReduceScatter of the gradient of conv1.weight over 8 devices (HCCS+PCIe), 18.82 KB, then AllGather" in section
    )
    assert "ReduceScatter of the gradient of flatten over 2 devices (HCCS), 262.14 KB" in section
    mesh = page.split("<section id='mesh'>")[1].split("</section>")[0]
    assert "HCCS" in mesh and "PCIe" in mesh and "<svg" in mesh


def test_a_plan_file_alone_says_what_it_cannot_compare(resnet):
    _, data = resnet
    page = report_html(json.loads(json.dumps(data)))
    assert parse(page).problems == []
    assert "needs the plan on its problem" in page  # stand-alone
    assert "needs the data-parallel plan" in page


def test_warnings_name_idle_devices_replication_and_fallbacks(resnet):
    _, data = resnet
    assert warnings_of(data) == []
    assert (
        "Idle devices: the largest split uses 8 of 16 devices"
        in warnings_of({**data, "devices": 16, "mesh_bits": 4})[0]
    )
    alone = autopar.plan(RESNET50, devices=8, mode="stand_alone").to_dict()
    assert "fully replicated" in warnings_of(alone)[0]
    assert "1 operator(s) have no strategy rule" in " ".join(warnings_of({**data, "fallback_ops": ["odd"]}))
    assert "fully replicated" in report_html(alone)


def test_the_plans_warnings_count_devices_as_the_strategy_map_does(resnet):
    from autopar.lowering.advice import devices_used

    _, data = resnet
    gpt = autopar.plan(export_gpt(), devices=8).file
    for plan_file in (as_plan_file(data), gpt):
        image = is_image_model(plan_file)
        assert [devices_used(op) for op in plan_file.ops] == [axis_splits(op, image)[1] for op in plan_file.ops]


def test_jupyter_shows_the_report(resnet):
    plan, _ = resnet
    fragment = plan._repr_html_()
    assert "autopar plan: resnet50 on 8 devices" in fragment and "<!doctype" not in fragment
    parsed = parse(fragment)
    assert parsed.problems == [] and parsed.stack == []
    assert [i for i in parsed.ids if i in SECTIONS] == [key for key in SECTIONS if key != "schedule"]


def test_the_cli_writes_the_page_and_says_where(capsys, tmp_path, monkeypatch):
    out = tmp_path / "r.html"
    code, stdout, stderr = run_cli(capsys, "report", RESNET50, "--devices", "8", "-o", out)
    assert code == 0 and stdout == ""
    assert f"autopar: wrote {out}" in stderr
    assert parse(out.read_text(encoding="utf-8")).problems == []
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_cli(capsys, "report", _abs(RESNET50), "--batch", "64")
    assert code == 0 and "autopar: wrote resnet50.report.html" in stderr
    page = (tmp_path / "resnet50.report.html").read_text(encoding="utf-8")
    assert "64 samples a step" in page
    code, _, stderr = run_cli(capsys, "report", _abs(RESNET50), "--devices", "3")
    assert code == 2 and "power of two" in stderr


def _abs(path: str) -> Path:
    return Path(__file__).resolve().parent.parent / path


BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed")
def test_a_browser_renders_the_page(resnet, tmp_path):
    from PIL import Image

    from autopar.report.html import plan_report

    page = tmp_path / "report.html"
    page.write_text(plan_report(resnet[0], autopar.api.comparison(resnet[0])), encoding="utf-8")
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            str(BROWSER),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,2000",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2000)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, cards, the coloured map: not a blank page
    white = sum(count for count, colour in colours if colour == (255, 255, 255))
    assert white < 0.95 * image.size[0] * image.size[1]


def test_a_pipelined_plans_timeline_and_stand_alone_card_mean_what_they_say():
    """A pipelined plan's step splits into forward and backward in the shares its operators have (not all of
    its compute as forward), and its stand-alone plan is the whole batch's on every device, one stage (not
    the plan itself, a speed-up of 1); a stand-alone plan no device can hold gets no speed-up, and the card
    says why."""
    from autopar.api import comparison, compute_split
    from autopar.report.figures import summary_figures
    from autopar.report.sections import summary_section

    model = build_preset("gpt2", layers=4)
    plan = autopar.plan(model, devices=8, pipeline_stages=2, micro_batches=4)
    assert plan.pipeline is not None
    data = plan.file
    forward, recompute = compute_split(plan)
    phases = dict(timeline_phases(data, forward, recompute))
    assert 0 < phases["forward"] < phases["backward"]
    assert phases["forward"] + phases["backward"] == pytest.approx(data.totals.compute_s, rel=1e-9)
    other = comparison(plan)
    assert other.stand_alone.pipeline is None and other.stand_alone.memory_plan.micro_batches == 1
    assert other.stand_alone.totals.step_time_s != data.totals.step_time_s
    speedup = summary_figures(data, other.stand_alone)["speedup_vs_stand_alone"]
    assert speedup == pytest.approx(other.stand_alone.totals.step_time_s / data.totals.step_time_s)
    used, whole = data.totals.memory_per_device_bytes, other.stand_alone.totals.memory_per_device_bytes
    assert used < whole
    small = autopar.plan(
        model, devices=8, pipeline_stages=2, micro_batches=4, cost_model=profile(capacity=(used + whole) / 2)
    )
    alone = comparison(small).stand_alone
    assert summary_figures(small.file, alone)["speedup_vs_stand_alone"] is None
    assert "does not fit one device" in summary_section(small.file, alone)


def test_the_table_says_a_replicated_plan_splits_nothing():
    """A plan whose operators all run whole is not called data parallel (which splits the batch)."""
    gpt = Path(__file__).parent / "data" / "torch_gpt_dynamo.onnx"
    whole = autopar.plan(gpt, devices=8)
    assert whole.degrees.data == 1
    said = "decisions: every one of the 69 operators"
    assert f"{said} runs whole on every device" in autopar.report.plan_table(whole)
    batch = autopar.plan(gpt, devices=4, mode="data_parallel")
    assert f"{said} is plain data parallel (splits the batch alone)" in autopar.report.plan_table(batch)
