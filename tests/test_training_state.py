"""What training keeps and how fast matmuls run: the optimizer's state, the memory reserve, the matmul efficiency.

Golden numbers worked by hand: Adam in mixed precision keeps 2 + 2 + 4 + 8 = 16 bytes a parameter
(ZeRO, Rajbhandari et al. SC20, section 3.1), momentum SGD 12; a plan may fill the device's memory
less the profile's reserve; a MatMul runs at the large-matmul efficiency times the profile's
fall-off at its smallest per-device dimension.
"""

from __future__ import annotations

import math
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import autopar
from autopar.cost import CostModel, HardwareProfile, load_profile
from autopar.cost.model import OPTIMIZER_STATE_BYTES
from autopar.cost.profile import profiles_dir
from autopar.errors import AutoparError, CostModelError, InfeasibleError, MemoryReserveError
from autopar.options import PlanOptions
from tests.conftest import make_model, profile, run_cli, simple_profile_dict, two_matmul_chain, weight

PARAMETERS = 8 * 16 + 16 * 4  # two_matmul_chain's W1 and W2


# --- the optimizer's state ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("optimizer", "precision", "per_parameter"),
    [
        ("adam", "mixed", 2 + 2 + 4 + 8),  # FP16 weights and gradient, FP32 master and two moments: ZeRO's 16 Psi
        ("sgd", "mixed", 2 + 2 + 4 + 4),  # one FP32 momentum instead of two moments
        ("adam", "fp32", 4 + 4 + 8),  # FP32 weights are the master copy
        ("sgd", "fp32", 4 + 4 + 4),
    ],
)
def test_parameter_state_of_a_tiny_model_by_hand(optimizer, precision, per_parameter):
    plan = autopar.plan(two_matmul_chain(), devices=1, cost_model=profile(), optimizer=optimizer, precision=precision)
    assert plan.file.totals.memory_breakdown["parameter_state"] == PARAMETERS * per_parameter
    assert plan.file.optimizer == optimizer


def test_the_profile_names_the_default_optimizer():
    for name in ("ascend910", "a100", "h100"):
        default = load_profile(name).training.optimizer
        assert default.value == "sgd" and "--optimizer adam" in (default.source or "")
        assert CostModel(load_profile(name)).optimizer == "sgd"
    assert autopar.plan(two_matmul_chain(), devices=1, cost_model=profile()).file.optimizer == "sgd"
    assert OPTIMIZER_STATE_BYTES == {"adam": 8.0, "sgd": 4.0}


def test_a_parallel_optimizer_shards_either_optimizers_state():
    for optimizer, state in (("adam", 4 + 2 + 8), ("sgd", 4 + 2 + 4)):
        cost = CostModel(load_profile("a100"), optimizer=optimizer)
        assert cost.parameter_bytes_split(True) == (2.0, state)
        assert cost.parameter_bytes_per_element(True, state_shards=4) == 2.0 + state / 4
        assert cost.parameter_bytes_per_element(False) == 4.0  # a frozen parameter keeps no state


def test_a_parallel_optimizer_plan_with_adam_counts_the_shards():
    # 8 devices, data parallel everywhere would hold 16 B a parameter; the plan's figure is what its items say
    plan = autopar.plan(two_matmul_chain(batch=64), devices=8, cost_model=profile(), optimizer="adam")
    items = [item for i, c in enumerate(plan.choice) for item in plan.problem.memory_items(i, c, plan.search.choices)]
    state = sum(nbytes for _, role, nbytes in items if role == "parameter")
    assert plan.file.totals.memory_breakdown["parameter_state"] == round(state)
    assert state <= PARAMETERS * 16


def test_an_unknown_optimizer_is_one_sentence():
    with pytest.raises(AutoparError, match=r"^Unknown optimizer 'rmsprop'; choose one of: adam, sgd\.$"):
        PlanOptions(optimizer="rmsprop")
    with pytest.raises(CostModelError, match="Unknown optimizer"):
        CostModel(load_profile("a100"), optimizer="rmsprop")  # type: ignore[arg-type]


def test_a_profile_with_the_old_optimizer_numbers_is_told_what_to_write(tmp_path):
    path = tmp_path / "old.toml"
    bundled = (profiles_dir() / "a100.toml").read_text(encoding="utf-8")
    old = re.sub(
        r"^optimizer = .*$",
        'optimizer_state_bytes_per_param = { value = 4.0, source = "SGD momentum" }\n'
        'master_weight_bytes_per_param = { value = 4.0, source = "FP32 master" }',
        bundled,
        flags=re.MULTILINE,
    )
    path.write_text(old, encoding="utf-8")
    with pytest.raises(CostModelError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert "optimizer_state_bytes_per_param and master_weight_bytes_per_param" in message
    assert "--optimizer adam|sgd" in message and "\n" not in message


# --- the memory reserve ---------------------------------------------------------------------------


def test_the_reserve_lowers_the_usable_capacity():
    a100 = load_profile("a100")
    assert a100.compute.memory_reserve.value == 8e9 and a100.compute.memory_reserve.source.startswith("assumed")
    assert CostModel(a100).capacity == 72e9 and CostModel(a100).device_capacity == 80e9
    assert CostModel(a100, memory_reserve=0).capacity == 80e9
    assert CostModel(a100, memory_reserve=4e9).capacity == 76e9
    assert CostModel(load_profile("ascend910")).capacity == pytest.approx(28.8e9)
    # the plan autopar made for Llama-3-8B on 8 A100s filled 79.7 GB: more than a plan may fill now
    assert CostModel(a100).capacity < 79.7e9


def test_a_plan_that_fills_the_device_is_not_made_with_a_reserve():
    model = two_matmul_chain(batch=4096)
    needed = autopar.plan(model, devices=1, cost_model=profile(), micro_batches=1).memory_per_device
    device = profile(capacity=needed / 0.996)  # the plan would fill 99.6% of it, as 79.7 of 80 GB
    filled = autopar.plan(model, devices=1, cost_model=device, micro_batches=1, memory_reserve=0)
    assert filled.memory_per_device == needed and filled.file.totals.memory_reserve_bytes == 0
    with pytest.raises(InfeasibleError) as caught:
        autopar.plan(model, devices=1, cost_model=device, micro_batches=1, memory_reserve=device_reserve(device))
    message = str(caught.value)
    assert "usable" in message and "reserve" in message and "sgd" in message


def device_reserve(device: HardwareProfile) -> float:
    """A100's share of the device kept free (8 of 80 GB), on this device."""
    return device.compute.hbm_capacity.value * 0.1


def test_the_plan_file_says_the_reserve_and_the_usable_capacity():
    plan = autopar.plan(two_matmul_chain(), devices=1, cost_model="a100", memory_reserve="4GB")
    totals = plan.file.totals
    assert (totals.memory_capacity_bytes, totals.memory_reserve_bytes, totals.memory_usable_bytes) == (
        80_000_000_000,
        4_000_000_000,
        76_000_000_000,
    )
    assert plan.to_dict()["totals"]["memory_reserve_bytes"] == 4_000_000_000
    table = autopar.report.plan_table(plan, 5)
    assert "of 76.00 GB usable" in table and "the device's 80.00 GB less a 4.00 GB reserve" in table


@pytest.mark.parametrize("value", ["4 apples", "-1GB", "", float("nan"), -1.0, True, [4]])
def test_a_bad_reserve_is_one_sentence(value):
    with pytest.raises(MemoryReserveError, match=r"^The memory reserve must be a size such as 4GB"):
        PlanOptions(memory_reserve=value)


def test_a_reserve_that_leaves_nothing_is_one_sentence():
    with pytest.raises(MemoryReserveError, match=r"leaves nothing of the device's 80\.00 GB \(a100\)"):
        CostModel(load_profile("a100"), memory_reserve=80e9)
    data = simple_profile_dict(capacity=1e9)
    data["compute"]["memory_reserve"] = {"value": 2e9, "source": "test value"}
    with pytest.raises(ValueError, match=r"memory_reserve \(2e\+09 B\) must be below hbm_capacity"):
        HardwareProfile.model_validate(data)


# --- the flags ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "chain.onnx"
    onnx.save(two_matmul_chain(batch=64), path)
    return path


def test_the_flags_set_the_optimizer_and_the_reserve(capsys, tiny_file):
    import json

    code, out, _ = run_cli(
        capsys, "plan", tiny_file, "--devices", "1", "--cost-model", "a100", "--optimizer", "adam",
        "--memory-reserve", "512MiB", "--format", "json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["optimizer"] == "adam" and data["totals"]["memory_reserve_bytes"] == 512 * 2**20
    assert data["totals"]["memory_breakdown"]["parameter_state"] == PARAMETERS * 16
    code, out, _ = run_cli(capsys, "sweep", tiny_file, "--devices", "1,2", "--optimizer", "sgd", "--format", "json")
    assert code == 0 and len(json.loads(out)) == 2
    code, out, _ = run_cli(
        capsys, "verify", tiny_file, "--devices", "2", "--optimizer", "adam", "--memory-reserve", "0"
    )
    assert code == 0


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--memory-reserve", "4apples"], "--memory-reserve must be a size such as 4GB"),
        (["--memory-reserve=-4GB"], "--memory-reserve must be a size such as 4GB"),
        (["--memory-reserve", "40GB"], "The memory reserve of 40.00 GB leaves nothing of the device's 32.00 GB"),
        (["--optimizer", "rmsprop"], "--optimizer: invalid choice: 'rmsprop'"),
    ],
)
def test_bad_flags_exit_2_with_one_sentence(capsys, tiny_file, flags, said):
    code, out, err = run_cli(capsys, "plan", tiny_file, "--devices", "1", *flags)
    assert code == 2 and out == ""
    assert err.startswith("autopar: error: ") and said in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_report_with_a_plan_file_takes_no_optimizer(capsys, tiny_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    code, _, _ = run_cli(capsys, "plan", tiny_file, "--devices", "1", "--format", "json", "-o", plan_path)
    assert code == 0
    code, _, err = run_cli(capsys, "report", tiny_file, "--plan", plan_path, "--optimizer", "adam")
    assert code == 2 and "--optimizer" in err


# --- the matmul efficiency ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ascend910", "a100", "h100"])
def test_the_matmul_table_is_monotone_and_sourced(name):
    bundled = load_profile(name)
    falloff = bundled.compute.matmul_falloff
    assert list(falloff.smallest_dim) == sorted(falloff.smallest_dim) and falloff.factor[-1] == 1.0
    assert all(a <= b for a, b in zip(falloff.factor, falloff.factor[1:]))
    assert falloff.source and falloff.source.startswith("measured: bench/gemm_efficiency.py")
    efficiency = bundled.compute.matmul_efficiency
    assert efficiency.source and (
        "Maximum Achievable Matmul FLOPS" in efficiency.source
        or efficiency.source.startswith(("assumed", "fitted on Megatron-LM", "fitted: bench/calibrate.py --fit"))
    )
    cost = CostModel(bundled)
    rates = cost.matmul_rate(np.array([1, 8, 32, 48, 64, 100, 256, 1000, 1024, 4096, 1e6]))
    assert np.all(np.diff(rates) >= 0)
    assert rates[-1] == pytest.approx(cost.peak_flops * efficiency.value)
    if name == "ascend910":  # fitted to MindSpore's BERT-Large, a little below the convolutions' ResNet-50 fit
        assert 0.8 * cost.cube_flops < rates[-1] < cost.cube_flops and "BERT-Large" in efficiency.source
    else:  # large matmuls run far above the convolutions' fitted efficiency on the GPUs
        assert rates[-1] > 2.5 * cost.cube_flops


def test_the_matmul_falloff_interpolates_on_log2_of_the_size():
    cost = CostModel(load_profile("a100"))
    large = 312e12 * 0.74
    assert cost.matmul_rate(48) == pytest.approx(large * (0.12 + math.log2(48 / 32) * (0.23 - 0.12)))
    assert cost.matmul_rate(16) == pytest.approx(large * 0.12)  # below the table: its first factor
    assert cost.matmul_rate(1 << 20) == pytest.approx(large)


def test_a_bad_falloff_table_is_one_sentence():
    for falloff, said in (
        ({"smallest_dim": [64, 32], "factor": [0.5, 1.0]}, "smallest_dim must be whole sizes from 1 up, increasing"),
        ({"smallest_dim": [32, 64], "factor": [1.0, 0.5]}, "factor must not fall as the size grows"),
        ({"smallest_dim": [32, 64], "factor": [1.0]}, "gives 2 sizes but 1 factors"),
    ):
        data = simple_profile_dict()
        data["compute"]["matmul_falloff"] = {**falloff, "source": "test value"}
        with pytest.raises(ValueError, match=said):
            HardwareProfile.model_validate(data)


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("optimizer = 3", 'training.optimizer must be adam or sgd, or { value = "adam"'),
        ('optimizer = { value = "lion", source = "x y z" }', "training.optimizer must be 'adam' or 'sgd', got 'lion'"),
        ("matmul_falloff = 0.5", "compute.matmul_falloff must be a table { smallest_dim = [32, ...]"),
    ],
)
def test_a_malformed_optimizer_or_falloff_is_one_sentence(tmp_path, line, said):
    text = (profiles_dir() / "a100.toml").read_text(encoding="utf-8")
    key = line.split(" =")[0]
    path = tmp_path / "bad.toml"
    path.write_text(re.sub(rf"^{key} = .*$", line, text, flags=re.MULTILINE), encoding="utf-8")
    with pytest.raises(CostModelError) as caught:
        load_profile(path)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def gemm_model(m: int, k: int, n: int) -> onnx.ModelProto:
    """Y = X @ W, X [m, k] a data input and W [k, n] a trainable weight."""
    node = helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")
    return make_model([node], [("X", TensorProto.FLOAT, [m, k])], ["Y"], [weight("W", [k, n])])


def test_golden_gemm_time_on_a100():
    # M = 256, K = 1024, N = 4096 on one A100, mixed precision: the smallest dimension is 256, where the
    # fall-off table gives 0.70 of the large-matmul efficiency 0.74: 312e12 x 0.74 x 0.70 = 161.616 TFLOP/s.
    flops = 2 * 256 * 1024 * 4096
    rate = 312e12 * 0.74 * 0.70
    traffic = (256 * 1024 + 1024 * 4096 + 256 * 4096) * 2  # FP16 operands and output: 6.75 us at 80% of 2,039 GB/s
    forward = flops / rate  # 13.288 us: compute-bound
    assert forward > traffic / (2.039e12 * 0.8)
    cost = CostModel(load_profile("a100"))
    assert cost.compute_time("cube", flops, traffic, matmul_dim=256) == pytest.approx(forward, rel=1e-12)
    assert forward == pytest.approx(13.288e-6, rel=1e-4)
    plan = autopar.plan(gemm_model(256, 1024, 4096), devices=1, cost_model="a100")
    node = 0  # the model's one operator
    # the weight needs a gradient, the data input does not: one backward product of the same size
    assert float(plan.problem.node_compute[node][0]) == pytest.approx(2 * forward, rel=1e-12)
    # the lowering reports what the search charged
    assert plan.file.ops[node].cost.compute_s == pytest.approx(2 * forward, rel=1e-6)


def test_splitting_a_matmul_shrinks_its_shape_and_its_efficiency():
    # on 8 devices the data-parallel candidate leaves 32 rows a device: 0.12 of the large-matmul rate
    problem = autopar.build(gemm_model(256, 1024, 4096), devices=8, cost_model="a100")
    rule = problem.rules[0]
    data_parallel = rule.candidates.index(rule.candidates[0])
    flops = 2 * 256 * 1024 * 4096 / 8
    expected = 2 * flops / (312e12 * 0.74 * 0.12)
    assert float(problem.node_compute[0][data_parallel]) == pytest.approx(expected, rel=1e-12)


def test_convolutions_keep_the_fitted_efficiency():
    from tests.conftest import conv_model

    problem = autopar.build(conv_model(), devices=1, cost_model="a100")
    conv = next(i for i, rule in enumerate(problem.rules) if rule.op.op_type == "Conv")
    assert problem.rules[conv].spec.matmul_labels is None
    cost = problem.cost
    op = problem.rules[conv].op
    forward = op.flops / cost.cube_flops
    passes = 1 + problem.backward_passes(conv)
    assert float(problem.node_compute[conv][0]) >= forward * passes * (1 - 1e-12)
