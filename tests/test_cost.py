"""The cost model: profile validation and collective formulas worked by hand."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import autopar
from autopar.cost import CostModel, HardwareProfile, available_profiles, load_profile
from autopar.errors import CostModelError
from tests.conftest import simple_profile_dict, two_matmul_chain


def test_bundled_profile_names_a_source_for_every_number():
    profile = load_profile("ascend910")
    numbers = list(profile.compute.model_dump().values()) + list(profile.training.model_dump().values())
    numbers += [v for link in profile.links for v in (link.bandwidth.model_dump(), link.latency.model_dump())]
    assert numbers and all(len(entry["source"]) > 10 for entry in numbers if entry is not None)
    assert profile.compute.attention_efficiency is None  # no fused attention kernel on the Ascend 910
    assert profile.compute.peak_flops_fp16.value == 256e12
    assert [link.name for link in profile.links] == ["HCCS", "PCIe", "RoCE"]
    assert "ascend910" in available_profiles()


def test_bits_map_to_ascend_levels():
    profile = load_profile("ascend910")
    assert [profile.level_of_bit(b).name for b in range(6)] == ["HCCS", "HCCS", "PCIe", "RoCE", "RoCE", "RoCE"]


def test_ring_allreduce_by_hand():
    cost = CostModel(load_profile("ascend910"))
    # 4 ranks on HCCS (30 GB/s, 5 us): ReduceScatter + AllGather, each 3 steps of 1/4 of 1 MB
    expected = 2 * 3 * (5e-6 + 1e6 / 4 / 30e9)
    assert cost.collective_time("AllReduce", (1, 0), 1e6) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_reduce_scatter_by_hand():
    cost = CostModel(load_profile("ascend910"))
    # bits 0,1 (HCCS, 4 ranks) then bit 2 (PCIe, 2 ranks, 32 GB/s, 10 us) on a quarter of the payload
    expected = 3 * (5e-6 + 8e6 / 4 / 30e9) + 1 * (10e-6 + (8e6 / 4) / 2 / 32e9)
    assert cost.collective_time("ReduceScatter", (2, 1, 0), 8e6) == pytest.approx(expected, rel=1e-12)
    assert cost.collective_time("Slice", (0,), 8e6) == 0.0
    assert cost.collective_time("AllGather", (), 8e6) == 0.0


def test_all_to_all_by_hand():
    cost = CostModel(load_profile("ascend910"))
    expected = 1 * (20e-6 + 1e6 / 2 / 12.5e9)  # bit 3 crosses servers over RoCE
    assert cost.collective_time("AllToAll", (3,), 1e6) == pytest.approx(expected, rel=1e-12)


def test_gradient_fusion_amortises_latency():
    cost = CostModel(load_profile("ascend910"))
    small = cost.gradient_sync_time((0,), 64e3)
    assert small == pytest.approx(2 * (5e-6 * 64e3 / 64e6 + 64e3 / 2 / 30e9), rel=1e-12)


def test_roofline_and_precision():
    mixed = CostModel(load_profile("ascend910"), "mixed")
    fp32 = CostModel(load_profile("ascend910"), "fp32")
    assert mixed.activation_itemsize("float32") == 2 and fp32.activation_itemsize("float32") == 4
    assert mixed.activation_itemsize("int64") == 8
    flops = 1e12
    cube_rate = 256e12 * mixed.profile.compute.cube_efficiency.value
    assert mixed.compute_time("cube", flops, 0) == pytest.approx(flops / cube_rate)
    assert fp32.compute_time("cube", flops, 0) > mixed.compute_time("cube", flops, 0)
    assert mixed.compute_time("vector", 0, 1e9) == pytest.approx(1e9 / (1.2e12 * 0.8))
    assert mixed.compute_time("free", 1e12, 1e12) == 0.0
    assert mixed.parameter_bytes_per_element(True) == 12 and fp32.parameter_bytes_per_element(True) == 12


def test_profile_errors_are_one_sentence(tmp_path):
    with pytest.raises(CostModelError, match="Unknown cost model"):
        load_profile("nosuch")
    with pytest.raises(CostModelError, match="does not exist"):
        load_profile(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\n[compute]\npeak_flops_fp16 = 3\n")
    with pytest.raises(CostModelError, match=r"bad\.toml"):
        load_profile(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("not [valid")
    with pytest.raises(CostModelError, match="not valid TOML"):
        load_profile(broken)
    data = simple_profile_dict()
    data["compute"]["hbm_capacity"] = {"value": 1.0, "source": ""}
    with pytest.raises(ValidationError):
        HardwareProfile.model_validate(data)
    with pytest.raises(CostModelError):
        CostModel(load_profile("ascend910"), "fp8")  # type: ignore[arg-type]


def test_the_mesh_is_the_plan_files_devices_bits_and_links():
    """`Mesh` (cost/mesh.py) carries what the plan file lists: devices, mesh bits, each level's bits."""
    from pathlib import Path

    import autopar
    from autopar.cost import load_profile
    from autopar.cost.mesh import Mesh
    from autopar.cost.rank_table import read_rank_table

    tables = Path(__file__).resolve().parent / "data"
    cases = [(load_profile("ascend910"), 8, None), (load_profile("ascend910"), 64, None)]
    cluster = read_rank_table(tables / "rank_table_16.json", load_profile("ascend910"))
    cases.append((cluster.profile, 16, tables / "rank_table_16.json"))
    for profile, devices, table in cases:
        mesh = Mesh.of(profile, devices)
        file = autopar.plan("models/resnet50.onnx", devices=devices, rank_table=table, mode="data_parallel").file
        assert (mesh.num_devices, mesh.mesh_bits) == (file.devices, file.mesh_bits)
        assert [(level.name, list(level.bits)) for level in mesh.levels] == [(use.name, use.bits) for use in file.links]
        for level in mesh.levels:
            link = profile.level_of_bit(level.bits[0])
            assert (level.latency_s, level.bandwidth_bytes_per_s) == (link.latency.value, link.bandwidth.value)
        plan = autopar.plan("models/resnet50.onnx", devices=devices, rank_table=table, mode="data_parallel")
        assert plan.mesh == mesh  # the plan's own mesh is the one built from its profile
        read = file.mesh  # read back from the file: the same devices, bits and link names, no speeds
        assert (read.num_devices, read.mesh_bits, read.link_names()) == (devices, mesh.mesh_bits, mesh.link_names())
        assert read.axis_names == mesh.axis_names and read.shape == mesh.shape


def test_a_mesh_read_from_a_plan_file_refuses_what_it_cannot_know():
    import pytest

    import autopar
    from autopar.cost.mesh import Mesh
    from autopar.errors import AutoparError, PlanFileError
    from autopar.lowering import read_plan_file

    mesh = Mesh.named(8, [("HCCS", [0, 1]), ("PCIe", [2])], "ascend910")
    with pytest.raises(AutoparError, match=r"^The HCCS link's speed is unknown: this mesh was read from a plan file"):
        _ = mesh.levels[0].latency_s
    with pytest.raises(AutoparError, match="names mesh bit 3, which is outside the 8-device mesh"):
        Mesh.named(8, [("HCCS", [0, 1]), ("PCIe", [3])], "ascend910")
    with pytest.raises(AutoparError, match=r"names mesh bit 1, which is outside .* or on another link too"):
        Mesh.named(8, [("HCCS", [0, 1]), ("PCIe", [1])], "ascend910")
    data = autopar.plan("models/resnet50.onnx", devices=2, mode="data_parallel").to_dict()
    data["devices"] = 4
    with pytest.raises(PlanFileError, match=r"devices is 4 but mesh_bits is 1 \(devices must be 2 \*\* mesh_bits\)\.$"):
        read_plan_file(data)  # refused as it is read, before its mesh is asked for


@pytest.mark.parametrize(
    ("optimizer", "precision", "moved"),
    # read FP32 weights, gradient, state; write weights, state and, mixed, the FP16 copy
    [
        ("adam", "mixed", 4 + 2 + 8 + 4 + 8 + 2),
        ("adam", "fp32", 4 + 4 + 8 + 4 + 8),
        ("sgd", "mixed", 4 + 2 + 4 + 4 + 4 + 2),
    ],
)
def test_the_optimizer_update_moves_each_state_element_once(optimizer, precision, moved):
    """The update's bytes per parameter element, by hand, at the h100 profile's 3.35 TB/s times its memory
    efficiency of 0.8: a billion elements of Adam in mixed precision take 28 GB / 2.68 TB/s = 10.4 ms."""
    cost = CostModel(load_profile("h100"), precision, optimizer=optimizer)
    assert cost.update_bytes_per_element() == moved
    assert cost.update_time(1e9) == pytest.approx(moved * 1e9 / (3.35e12 * 0.8), rel=1e-12)


def _with_fp8(peak: float = 4e12) -> HardwareProfile:
    data = simple_profile_dict()
    data["compute"]["peak_flops_fp8"] = {"value": peak, "source": "test value"}
    return HardwareProfile.model_validate(data)


def test_fp8_runs_the_products_at_the_fp8_peak_and_keeps_what_only_they_keep_in_one_byte():
    """Z = (X @ W1) @ W2 on 2 devices, data parallel: mm1 does 1,024 FLOPs and needs only dW1 (x2), mm2 512 and
    needs dY and dW2 (x3), each halved, at the FP8 peak of 4e12 instead of the FP16 1e12. Y (a 2 x 16 shard)
    is kept only for mm2's weight gradient: 64 B in FP16, 32 in FP8. Everything else is as in mixed precision."""
    strategies = {"mm1": ((2, 1), (1, 1)), "mm2": ((2, 1), (1, 1))}

    def planned(precision: str):
        return autopar.plan(
            two_matmul_chain(),
            devices=2,
            cost_model=_with_fp8(),
            precision=precision,
            fixed=strategies,
            mode="semi_auto_parallel",
        ).to_dict()

    fp8, mixed = planned("fp8"), planned("mixed")
    assert fp8["totals"]["compute_s"] == pytest.approx((1024 / 2 / 4e12) * 2 + (512 / 2 / 4e12) * 3, rel=1e-9)
    assert mixed["totals"]["compute_s"] == pytest.approx((1024 / 2 / 1e12) * 2 + (512 / 2 / 1e12) * 3, rel=1e-9)
    assert mixed["totals"]["memory_breakdown"]["activations"] == 64
    assert fp8["totals"]["memory_breakdown"]["activations"] == 32
    assert (
        fp8["totals"]["memory_breakdown"]["parameter_state"] == mixed["totals"]["memory_breakdown"]["parameter_state"]
    )


def test_fp8_on_a_device_without_fp8_units_is_refused_as_a_flag(tmp_path):
    from autopar.cli import main
    from autopar.errors import PrecisionError

    with pytest.raises(PrecisionError, match=r"^The simple profile has no FP8 matrix units"):
        CostModel(HardwareProfile.model_validate(simple_profile_dict()), "fp8")
    assert main(["plan", "models/resnet50.onnx", "--devices", "2", "--precision", "fp8", "--quiet"]) == 2
