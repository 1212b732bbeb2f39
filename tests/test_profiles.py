"""Profiles a person can write: bundled GPU profiles, plain numbers, one-sentence errors, `autopar profiles`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import onnx
import pytest

from autopar.cost import CostModel, HardwareProfile, available_profiles, load_profile
from autopar.cost.profile import UnsourcedNumberWarning
from autopar.errors import AutoparWarning, CostModelError
from models.resnet50 import build_resnet50
from tests.conftest import run_cli, simple_profile_dict

REPO = Path(__file__).resolve().parents[1]
ASCEND910 = (REPO / "costmodels" / "ascend910.toml").read_text(encoding="utf-8")


def numbers(profile: HardwareProfile) -> dict[str, dict]:
    """Every sourced number of a profile by its dotted name."""
    named = {f"compute.{k}": v for k, v in profile.compute.model_dump().items() if v is not None}
    named |= {f"training.{k}": v for k, v in profile.training.model_dump().items()}
    for i, level in enumerate(profile.links):
        named |= {
            f"links[{i}].bandwidth": level.bandwidth.model_dump(),
            f"links[{i}].latency": level.latency.model_dump(),
        }
    return named


# --- the bundled profiles -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ascend910", "a100", "h100", "h200"])
def test_bundled_profiles_name_a_source_for_every_number(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsourcedNumberWarning)  # a bundled profile never warns
        profile = load_profile(name)
    assert name in available_profiles() and profile.name == name and profile.description
    for field, entry in numbers(profile).items():
        assert len(entry["source"]) > 10, field
    # what is not published says so
    assert profile.compute.memory_efficiency.source.startswith("assumed")
    for level in profile.links:
        assert level.latency.source.startswith("assumed")


@pytest.mark.parametrize(
    ("name", "fp16", "tf32", "hbm", "capacity", "nvlink", "infiniband"),
    [
        ("a100", 312e12, 156e12, 2.039e12, 80e9, 300e9, 25e9),
        ("h100", 989.4e12, 494.7e12, 3.35e12, 80e9, 450e9, 50e9),
        ("h200", 989.4e12, 494.7e12, 4.8e12, 141e9, 450e9, 50e9),  # the H100's compute, HBM3e
    ],
)
def test_gpu_profiles_datasheet_numbers(name, fp16, tf32, hbm, capacity, nvlink, infiniband):
    profile = load_profile(name)
    compute = profile.compute
    assert (compute.peak_flops_fp16.value, compute.peak_flops_fp32.value) == (fp16, tf32)
    assert "dense" in compute.peak_flops_fp16.source and "TF32" in compute.peak_flops_fp32.source
    assert (compute.hbm_bandwidth.value, compute.hbm_capacity.value) == (hbm, capacity)
    assert [(level.name, level.bits) for level in profile.links] == [("NVLink", 3), ("InfiniBand", 58)]
    assert [level.bandwidth.value for level in profile.links] == [nvlink, infiniband]
    assert [profile.level_of_bit(b).name for b in range(5)] == ["NVLink"] * 3 + ["InfiniBand"] * 2
    assert "DeepLearningExamples" in profile.training.optimizer.source and profile.training.optimizer.value == "sgd"
    # --precision fp32 is TF32 on the tensor cores: half the FP16 rate
    mixed, fp32 = CostModel(profile, "mixed"), CostModel(profile, "fp32")
    assert fp32.peak_flops == tf32 and mixed.peak_flops == fp16


def test_gpu_profiles_mark_fitted_and_assumed():
    a100, h100 = load_profile("a100"), load_profile("h100")
    assert a100.compute.cube_efficiency.source.startswith("fitted")
    assert h100.compute.cube_efficiency.source.startswith("assumed")
    assert h100.compute.cube_efficiency.value == a100.compute.cube_efficiency.value
    fitted = [field for profile in (a100, h100) for field, e in numbers(profile).items() if "fitted" in e["source"]]
    assert fitted == ["compute.cube_efficiency", "compute.matmul_efficiency", "compute.cube_efficiency"]
    assert "bench/megatron.py --fit" in a100.compute.matmul_efficiency.source


def test_hopper_profiles_have_a_fused_attention_kernel_and_fp8_the_others_do_not():
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert h200.compute.attention_efficiency.source.startswith("measured")
    assert h100.compute.attention_efficiency.value == h200.compute.attention_efficiency.value
    assert h100.compute.peak_flops_fp8.value == h200.compute.peak_flops_fp8.value == 1979e12
    for name in ("ascend910", "a100"):
        compute = load_profile(name).compute
        assert compute.attention_efficiency is None and compute.peak_flops_fp8 is None


# --- plain numbers: accepted, with a warning naming them -------------------------------------------


def test_plain_number_is_used_with_a_warning_naming_it():
    data = simple_profile_dict()
    data["compute"]["peak_flops_fp16"] = 312e12
    with pytest.warns(UnsourcedNumberWarning, match=r"compute\.peak_flops_fp16 has no source") as caught:
        profile = HardwareProfile.model_validate(data)
    assert len(caught) == 1 and issubclass(caught[0].category, AutoparWarning)
    assert profile.compute.peak_flops_fp16.value == 312e12 and profile.compute.peak_flops_fp16.source is None
    assert profile.unsourced() == ["compute.peak_flops_fp16"]


def test_plain_numbers_in_a_file_are_named_together(tmp_path):
    text = ASCEND910.replace(
        'hbm_bandwidth = { value = 1.2e12, source = "', 'hbm_bandwidth = 1.2e12\nx_ = { source = "'
    )
    text = re.sub(r"x_ = .*\n", "", text)
    text = re.sub(r'latency = \{ value = 20e-6, source = "[^"]*" \}', "latency = { value = 20e-6 }", text)
    path = tmp_path / "plain.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.warns(UnsourcedNumberWarning) as caught:
        profile = load_profile(path)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "Hardware profile 'ascend910': compute.hbm_bandwidth and links[2].latency have no source"
        ' (write { value = ..., source = "where it comes from" }).'
    )
    assert profile.compute.hbm_bandwidth.value == 1.2e12 and profile.links[2].latency.value == 20e-6


# --- errors: one plain sentence naming the field ---------------------------------------------------


def _edit(pattern: str, replacement: str) -> str:
    text, count = re.subn(pattern, replacement, ASCEND910, count=1, flags=re.MULTILINE)
    assert count == 1, pattern
    return text


def _without_links() -> str:
    head = ASCEND910[: ASCEND910.index("[[links]]")]
    return head.replace('name = "ascend910"', 'name = "ascend910"\nlinks = []')


BAD_PROFILES = {
    "missing field": (_edit(r"^hbm_bandwidth = .*\n", ""), "compute.hbm_bandwidth is missing"),
    "string for a number": (
        _edit(r"hbm_bandwidth = \{ value = 1.2e12", 'hbm_bandwidth = { value = "1.2e12"'),
        "compute.hbm_bandwidth must be a number or { value = <number>, source = \"...\" }, got '1.2e12'",
    ),
    "unknown key": (
        _edit(r"^\[compute\]\n", '[compute]\nhbm_speed = { value = 1, source = "typo" }\n'),
        "compute.hbm_speed is not a profile field; compute takes peak_flops_fp16, peak_flops_fp32, hbm_bandwidth,"
        " hbm_capacity, memory_reserve, cube_efficiency, matmul_efficiency, matmul_falloff, memory_efficiency,"
        " vector_flops_fraction, attention_efficiency, peak_flops_fp8",
    ),
    "unknown key in a number": (
        _edit(r"hbm_bandwidth = \{ value = 1.2e12,", 'hbm_bandwidth = { value = 1.2e12, unit = "B/s",'),
        "compute.hbm_bandwidth.unit is not a profile field; a number takes value and source",
    ),
    "NaN": (_edit(r"hbm_bandwidth = \{ value = 1.2e12", "hbm_bandwidth = { value = nan"), None),
    "inf": (
        _edit(r"hbm_bandwidth = \{ value = 1.2e12", "hbm_bandwidth = { value = inf"),
        "compute.hbm_bandwidth must be a finite number, got inf",
    ),
    "efficiency above 1": (
        _edit(r"cube_efficiency = \{ value = 0.50", "cube_efficiency = { value = 1.5"),
        "compute.cube_efficiency must be above 0 and at most 1, got 1.5",
    ),
    "negative": (
        _edit(r"latency = \{ value = 5e-6", "latency = { value = -5e-6"),
        "links[0].latency must be above 0, got -5e-06",
    ),
    "empty source": (
        _edit(r'hbm_capacity = \{ value = 32e9, source = "[^"]*"', 'hbm_capacity = { value = 32e9, source = ""'),
        "compute.hbm_capacity.source must say where the number comes from, got ''",
    ),
    "empty links": (
        _without_links(),
        "links must list at least one level ([[links]] with name, bits, bandwidth and latency)",
    ),
    "bits = 0": (_edit(r"^bits = 2$", "bits = 0"), "links[0].bits must be a whole number from 1 to 64, got 0"),
    "too few bits": (
        _edit(r"^bits = 58$", "bits = 3"),
        "links cover 6 mesh bits; they must cover at least 30 (give the last level the rest, e.g. bits = 61)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PROFILES))
def test_bad_profile_is_one_plain_sentence(tmp_path, case):
    text, expected = BAD_PROFILES[case]
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CostModelError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert message.startswith(f"Cost model {str(path)!r}: ") and message.endswith(".") and "\n" not in message
    assert "Value error" not in message and "input should" not in message.lower()
    if expected is None:  # NaN: the TOML value prints as nan
        expected = "compute.hbm_bandwidth must be a finite number, got nan"
    assert message == f"Cost model {str(path)!r}: {expected}."


# --- the command line ------------------------------------------------------------------------------


run = run_cli


def assert_one_line(err: str, prefix: str) -> None:
    assert err.startswith(prefix) and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_profiles_lists_each_with_its_description(capsys):
    code, out, err = run(capsys, "profiles")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == available_profiles() == ["a100", "ascend910", "h100", "h200"]
    for line in lines:
        name = line.split()[0]
        assert line.endswith(load_profile(name).description)


def test_profiles_show_prints_the_toml(capsys):
    code, out, err = run(capsys, "profiles", "show", "a100")
    assert code == 0 and err == ""
    assert out == (REPO / "costmodels" / "a100.toml").read_text(encoding="utf-8")


def test_profiles_show_unknown_name(capsys):
    code, out, err = run(capsys, "profiles", "show", "nosuch")
    assert code == 2 and out == ""
    assert_one_line(err, "autopar: error:")
    assert "'nosuch'" in err and "a100, ascend910, h100" in err


def test_profiles_show_checks_a_file(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_PROFILES["efficiency above 1"][0], encoding="utf-8")
    code, out, err = run(capsys, "profiles", "show", bad)
    assert code == 1 and out == ""
    assert_one_line(err, "autopar: error:")
    assert "compute.cube_efficiency must be above 0 and at most 1, got 1.5" in err


def test_profiles_show_warns_about_plain_numbers(capsys, tmp_path):
    plain = tmp_path / "plain.toml"
    text = _edit(r"hbm_bandwidth = \{ value = 1.2e12, source = \"[^\"]*\" \}", "hbm_bandwidth = 1.2e12")
    plain.write_text(text, encoding="utf-8")
    code, out, err = run(capsys, "profiles", "show", plain)
    assert code == 0 and out == text
    assert_one_line(err, "autopar: warning:")
    assert "compute.hbm_bandwidth has no source" in err


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.onnx"
    onnx.save(build_resnet50(batch=4, num_classes=10, image_size=32, width=8, blocks=(1, 1, 1, 1)), str(path))
    return path


def test_plan_with_a_plain_number_warns_once(capsys, tiny_path, tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text(_edit(r"peak_flops_fp16 = \{ value = 256e12, source = \"[^\"]*\" \}", "peak_flops_fp16 = 256e12"))
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "1", "--cost-model", plain, "--format", "json")
    assert code == 0 and out.startswith("{")
    assert_one_line(err, "autopar: warning:")
    assert "compute.peak_flops_fp16 has no source" in err


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_plan_on_gpu_profiles(capsys, tiny_path, name):
    code, out, err = run(capsys, "plan", tiny_path, "--devices", "16", "--cost-model", name, "--format", "json")
    assert code == 0  # stderr only says that the tiny model is too small to split over 16 devices
    assert all(line.startswith("autopar: warning: The model is fully replicated") for line in err.splitlines()), err
    assert f'"cost_model": "{name}"' in out
