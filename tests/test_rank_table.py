"""Clusters from MindSpore's rank table: the reader, the levels a table implies, the API and the command line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import pytest

import autopar
from autopar.cost import HardwareProfile, load_profile
from autopar.cost.rank_table import Cluster, MeshLevel, read_rank_table
from autopar.errors import RankTableError
from models.resnet50 import build_resnet50
from tests.conftest import run_cli, simple_profile_dict, sourced

REPO = Path(__file__).resolve().parents[1]
RESNET50 = REPO / "models" / "resnet50.onnx"
TABLE_8 = REPO / "tests" / "data" / "rank_table_8.json"  # MindSpore's tutorial table (the older group_list form)
TABLE_16 = REPO / "tests" / "data" / "rank_table_16.json"  # two 8-chip servers, rank table 1.0
TINY = dict(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1))


def table(*servers: Sequence[int], **fields: Any) -> dict[str, Any]:
    """A rank table 1.0: the device_ids of each server, ranks numbered in server then device order."""
    server_list, rank = [], 0
    for s, chips in enumerate(servers):
        devices = []
        for chip in chips:
            devices.append({"device_id": str(chip), "device_ip": f"192.168.{s}.{chip}", "rank_id": str(rank)})
            rank += 1
        server_list.append({"server_id": f"10.0.0.{s + 1}", "device": devices, "host_nic_ip": "reserve"})
    return {
        "version": "1.0",
        "server_count": str(len(servers)),
        "server_list": server_list,
        "status": "completed",
    } | fields


@pytest.fixture(scope="module")
def ascend910() -> HardwareProfile:
    return load_profile("ascend910")


def levels(cluster: Cluster) -> list[tuple[str, int]]:
    return [(level.name, level.bits) for level in cluster.levels]


def links(cluster: Cluster) -> list[tuple[str, int]]:
    return [(level.name, level.bits) for level in cluster.profile.links]


# --- the reader ---------------------------------------------------------------------------------


def test_seed_tutorial_table(ascend910):
    cluster = read_rank_table(TABLE_8, ascend910)
    assert (cluster.num_devices, cluster.num_servers, cluster.devices_per_server) == (8, 1, 8)
    assert cluster.levels == (MeshLevel("HCCS", 0, 2), MeshLevel("PCIe", 2, 1))
    assert cluster.describe() == "1 server x 8 devices; levels HCCS 2 bits (4 devices), PCIe 1 bit (8 devices)"
    assert links(cluster) == [("HCCS", 2), ("PCIe", 1), ("RoCE", 61)]


def test_two_server_table(ascend910):
    cluster = read_rank_table(TABLE_16, ascend910)
    assert (cluster.num_devices, cluster.num_servers, cluster.devices_per_server, cluster.mesh_bits) == (16, 2, 8, 4)
    assert levels(cluster) == [("HCCS", 2), ("PCIe", 1), ("RoCE", 1)]
    assert cluster.describe() == (
        "2 servers x 8 devices; levels HCCS 2 bits (4 devices), PCIe 1 bit (8 devices), RoCE 1 bit (16 devices)"
    )


def test_levels_keep_the_profile_numbers(ascend910):
    derived = read_rank_table(table(range(4), range(4)), ascend910).profile
    assert derived.compute == ascend910.compute and derived.training == ascend910.training
    by_name = {level.name: level for level in ascend910.links}
    for level in derived.links:
        assert (level.bandwidth, level.latency) == (by_name[level.name].bandwidth, by_name[level.name].latency)
    assert HardwareProfile.model_validate(derived.model_dump()) == derived  # still a valid profile


@pytest.mark.parametrize(
    ("servers", "expect", "describe"),
    [
        ([range(4)], [("HCCS", 2)], "1 server x 4 devices; levels HCCS 2 bits (4 devices)"),
        ([range(4, 8)], [("HCCS", 2)], "1 server x 4 devices; levels HCCS 2 bits (4 devices)"),
        ([(4, 5)], [("HCCS", 1)], "1 server x 2 devices; levels HCCS 1 bit (2 devices)"),
        ([(0,)], [], "1 server x 1 device; no links (one device)"),
        ([range(4)] * 2, [("HCCS", 2), ("RoCE", 1)], None),
        (
            [(0, 1)] * 4,
            [("HCCS", 1), ("RoCE", 2)],
            "4 servers x 2 devices; levels HCCS 1 bit (2 devices), RoCE 2 bits (8 devices)",
        ),
        ([(3,)] * 2, [("RoCE", 1)], "2 servers x 1 device; levels RoCE 1 bit (2 devices)"),
        ([range(8)] * 4, [("HCCS", 2), ("PCIe", 1), ("RoCE", 2)], None),
    ],
)
def test_levels_the_servers_imply(ascend910, servers, expect, describe):
    cluster = read_rank_table(table(*servers), ascend910)
    assert levels(cluster) == expect
    assert cluster.num_devices == sum(len(chips) for chips in servers)
    if describe:
        assert cluster.describe() == describe


def test_file_order_does_not_matter(ascend910):
    """Ranks, not the order of the lists, place devices on the mesh."""
    data = table(range(8), range(8))
    data["server_list"].reverse()
    for server in data["server_list"]:
        server["device"].reverse()
    assert read_rank_table(data, ascend910).levels == read_rank_table(TABLE_16, ascend910).levels


def test_rank_table_1_2_with_super_pods(ascend910):
    data = table(range(8), range(8), version="1.2")
    data["super_pod_list"] = [
        {"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.1"}, {"server_id": "10.0.0.2"}]}
    ]
    for server in data["server_list"]:
        for device in server["device"]:
            device["super_device_id"] = device["device_id"]
    assert levels(read_rank_table(data, ascend910)) == [("HCCS", 2), ("PCIe", 1), ("RoCE", 1)]


def test_integers_and_a_byte_order_mark(ascend910, tmp_path):
    data = table(range(8))
    for device in data["server_list"][0]["device"]:
        device["rank_id"], device["device_id"] = int(device["rank_id"]), int(device["device_id"])
    path = tmp_path / "rank_table.json"
    path.write_text(json.dumps(data), encoding="utf-8-sig")
    assert read_rank_table(path, ascend910).num_devices == 8


def gpu_profile() -> HardwareProfile:
    data = simple_profile_dict()
    data["links"] = [
        {"name": "NVLink", "bits": 3, "bandwidth": sourced(3e11), "latency": sourced(3e-6)},
        {"name": "InfiniBand", "bits": 40, "bandwidth": sourced(5e10), "latency": sourced(1e-5)},
    ]
    return HardwareProfile.model_validate(data)


def test_generic_rule_for_other_profiles():
    """Devices of a server share the levels before the last, up to the server's size; servers share the last."""
    gpu = gpu_profile()
    assert levels(read_rank_table(table(range(8), range(8)), gpu)) == [("NVLink", 3), ("InfiniBand", 1)]
    assert levels(read_rank_table(table(range(4), range(4, 8)), gpu)) == [("NVLink", 2), ("InfiniBand", 1)]
    one_level = HardwareProfile.model_validate(simple_profile_dict() | {"links": simple_profile_dict()["links"][1:]})
    cluster = read_rank_table(table(range(2), range(2)), one_level)
    assert cluster.profile.links == one_level.links and levels(cluster) == [("slow", 2)]


def test_devices_must_agree(ascend910):
    cluster = read_rank_table(TABLE_16, ascend910)
    assert cluster.devices_for(None) == cluster.devices_for(16) == 16
    with pytest.raises(RankTableError, match=r"^devices=8 disagrees with rank table '.*rank_table_16.json', which"):
        cluster.devices_for(8)


# --- the API ------------------------------------------------------------------------------------


def test_plan_with_rank_tables_equals_the_device_count():
    """The bundled profile's levels are an 8-chip server's, so the two tables plan as --devices does."""
    for path, devices in ((TABLE_8, 8), (TABLE_16, 16)):
        by_table = autopar.plan(RESNET50, rank_table=path)
        assert by_table.devices == devices
        assert by_table.objective == autopar.plan(RESNET50, devices=devices).objective
        assert autopar.evaluate(RESNET50, None, by_table.strategies, rank_table=path) == by_table.objective


def test_plan_with_servers_of_four_chips_crosses_roce():
    """Two 4-chip servers: mesh bit 2 is RoCE, not PCIe, and the step is slower than on one 8-chip server."""
    by_table = autopar.plan(RESNET50, rank_table=table(range(4), range(4)))
    assert by_table.problem.cost.profile.level_of_bit(2).name == "RoCE"
    assert by_table.objective > autopar.plan(RESNET50, devices=8).objective


def test_api_devices_must_agree():
    with pytest.raises(RankTableError, match=r"^devices=8 disagrees with the rank table, which describes 16 devices"):
        autopar.build(RESNET50, 8, rank_table=table(range(8), range(8)))


# --- the command line ---------------------------------------------------------------------------


run = run_cli


def test_cli_plan_shows_the_cluster(capsys):
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", TABLE_16)
    assert code == 0, err
    title, cluster = out.splitlines()[:2]
    assert title.startswith("autopar plan: resnet50 on 16 devices (ascend910,")
    assert cluster == (
        "cluster: 2 servers x 8 devices; levels HCCS 2 bits (4 devices), PCIe 1 bit (8 devices),"
        " RoCE 1 bit (16 devices)"
    )
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", TABLE_8, "--devices", "8", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["devices"] == 8
    assert "cluster:" not in out


def test_cli_verify_with_a_rank_table(capsys, tmp_path):
    model, rank_table = tmp_path / "tiny.onnx", tmp_path / "rank_table.json"
    onnx.save(build_resnet50(**TINY), str(model))
    rank_table.write_text(json.dumps(table((0, 1), (0, 1))))
    code, out, err = run(capsys, "verify", model, "--rank-table", rank_table)
    assert code == 0, err
    assert out.startswith("autopar verify: VERIFIED on 4 virtual devices")


def _tutorial_text() -> str:
    """The tutorial's table exactly as the tutorial prints it: a comma after the last instance."""
    text = TABLE_8.read_text()
    last = text.index('"server_id": "10.*.*.*"}', text.index('"rank_id": "7"')) + len('"server_id": "10.*.*.*"}')
    return text[:last] + "," + text[last:]


def _devices(data: dict[str, Any], server: int, device: int, **fields: Any) -> dict[str, Any]:
    data["server_list"][server]["device"][device].update(fields)
    return data


def _drop_rank(data: dict[str, Any]) -> dict[str, Any]:
    del data["server_list"][1]["device"][2]["rank_id"]
    return data


def _interleave(data: dict[str, Any]) -> dict[str, Any]:
    for s, server in enumerate(data["server_list"]):
        for d, device in enumerate(server["device"]):
            device["rank_id"] = str(2 * d + s)
    return data


def _legacy_server_num(text: str) -> str:
    return text.replace('"server_num": "1"', '"server_num": "2"')


# (file content, the sentence after "Rank table 'PATH': "); content is text, or JSON written out
MALFORMED: dict[str, tuple[Any, str | None]] = {
    "not JSON (the tutorial's trailing comma)": (_tutorial_text(), None),
    "not an object": ([1, 2], "it is not a rank table (a JSON object is expected, got an array)."),
    "neither form": (
        {"version": "1.0", "status": "completed"},
        "it has neither server_list (rank table 1.0 or 1.2) nor group_list (the older form), so it is not a"
        " MindSpore rank table (its keys: 'version', 'status').",
    ),
    "missing rank_id": (_drop_rank(table(range(8), range(8))), "server_list[1].device[2] has no 'rank_id'."),
    "rank_id of the wrong type": (
        _devices(table(range(8)), 0, 3, rank_id="three"),
        'server_list[0].device[3].rank_id must be a whole number ("3" or 3), got "three".',
    ),
    "server_list of the wrong type": (
        table(range(8)) | {"server_list": {"server_id": "x"}},
        "server_list must be a JSON array, got an object.",
    ),
    "duplicate rank_id": (
        _devices(table(range(8), range(8)), 1, 0, rank_id="3"),
        "rank_id 3 appears on server 0 ('10.0.0.1') and on server 1 ('10.0.0.2').",
    ),
    "rank_ids not 0..N-1": (
        _devices(table(range(8)), 0, 7, rank_id="8"),
        "rank_ids must number its 8 devices 0 to 7, but 8 is among them.",
    ),
    "duplicate device_id": (
        _devices(table(range(8)), 0, 7, device_id="6"),
        "device_id 6 appears twice on server 0 ('10.0.0.1').",
    ),
    "not a power of two": (
        table(range(6)),
        "each server holds 6 devices; autopar needs a power of two (1, 2, 4, 8, ...).",
    ),
    "three servers": (
        table(range(8), range(8), range(8)),
        "3 servers of 8 devices make 24, not a power of two; autopar needs a power of two of servers.",
    ),
    "servers of different sizes": (
        table(range(8), range(4)),
        "its servers hold different numbers of devices (8 on server 0 ('10.0.0.1'), 4 on server 1 ('10.0.0.2'));"
        " autopar needs the same number on every server.",
    ),
    "server_count mismatch": (
        table(range(8), range(8), server_count="4"),
        "server_count is 4, but server_list lists 2 servers.",
    ),
    "status initializing": (
        table(range(8), status="initializing"),
        "its status is \"initializing\", not 'completed' (HCCL reads a table only once it is complete).",
    ),
    "ranks interleaved across servers": (
        _interleave(table(range(8), range(8))),
        "server 0 ('10.0.0.1') holds ranks 0, 2, 4, 6, 8, 10, 12, 14; autopar needs each server's ranks"
        " consecutive (0-7 on one server, 8-15 on the next, ...).",
    ),
    "four chips across the HCCS groups": (
        table((0, 1, 4, 5)),
        "on server 0 ('10.0.0.1'), ranks 0-3 sit on device_ids 0, 1, 4, 5, which span HCCS groups (chips 0-3"
        " and 4-7); HCCS joins each run of 4 consecutive ranks, so their chips must be in one group.",
    ),
    "a chip beyond the server": (
        table((0, 8)),
        "device_id 8 on server 0 ('10.0.0.1') is beyond the 8 chips of a server in ascend910 (device_ids 0 to 7).",
    ),
    "servers larger than the profile's": (
        table(range(16)),
        "each server holds 16 devices, more than ascend910's server levels (HCCS, PCIe) join (8).",
    ),
    "legacy server_num mismatch": (
        _legacy_server_num(TABLE_8.read_text()),
        "group_list[0].server_num is 2, but the instances name 1 server.",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_cli_malformed_rank_table(capsys, tmp_path, case):
    content, sentence = MALFORMED[case]
    path = tmp_path / "rank_table.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", path)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    if sentence is None:  # json's words and where it stopped: the "]" after the comma
        assert err == f"autopar: error: Rank table {str(path)!r} is not JSON: expecting value at line 21, column 7.\n"
    else:
        assert err == f"autopar: error: Rank table {str(path)!r}: {sentence}\n"


def test_cli_rank_table_with_an_unterminated_string_says_where_it_starts_once(capsys, tmp_path):
    path = tmp_path / "rank_table.json"
    path.write_text('{"version": "1.0, "server_count": "1"}')
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", path)
    assert (code, out) == (1, "")
    assert err == (
        f"autopar: error: Rank table {str(path)!r} is not JSON: expecting ',' delimiter at line 1, column 20.\n"
    )
    path.write_text('{"version": "1.0}')
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", path)
    assert err == (
        f"autopar: error: Rank table {str(path)!r} is not JSON: unterminated string starting at line 1, column 13.\n"
    )


def test_cli_devices_disagree(capsys):
    code, out, err = run(capsys, "plan", RESNET50, "--rank-table", TABLE_8, "--devices", "16")
    assert (code, out) == (1, "")
    assert err == (
        f"autopar: error: --devices 16 disagrees with rank table {str(TABLE_8)!r}, which describes 8 devices;"
        " leave --devices out or make them agree.\n"
    )


@pytest.mark.parametrize(("where", "ending"), [("missing.json", "does not exist."), (".", "is a directory.")])
def test_cli_unreadable_rank_table(capsys, tmp_path, where, ending):
    path = tmp_path / where
    code, _, err = run(capsys, "plan", RESNET50, "--rank-table", path)
    assert code == 1
    assert err == f"autopar: error: Rank table {str(path)!r} {ending}\n"
