"""Bad input never yields a traceback, an internal error, a hang or a wrong plan (seeded and hypothesis).

A few hundred seeded cases per run, through the command line in this process; `bench/fuzz.py`
runs thousands, each in its own process.
"""

from __future__ import annotations

import string
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.cases import CATEGORIES, Case, _bytes, generate, run_in_process, tiny_chain

pytest.importorskip("onnxruntime")

CASES = generate(seed=2026, per_category=60)


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


@pytest.mark.parametrize("category", CATEGORIES)
def test_seeded_cases_end_well(category, folder):
    outcomes = [run_in_process(case, folder) for case in CASES if case.category == category]
    bad = [(o.case.label, o.case.argv, o.problem) for o in outcomes if o.problem]
    assert not bad, bad[:3]
    codes = Counter(o.code for o in outcomes)
    assert sum(codes.values()) == 60
    assert codes[1] + codes[2] > 0  # the generators do produce bad input


FLAG_TEXT = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.text(alphabet=string.printable, max_size=12),
    st.sampled_from(["8", "4", "1e3", "0x10", " 8", "８"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--devices", "--batch", "--dim", "--seed"]), value=FLAG_TEXT)
def test_any_flag_value_is_a_plan_or_one_sentence(flag, value, folder):
    command = "verify" if flag == "--seed" else "plan"
    value = f"N={value}" if flag == "--dim" else value
    argv = [command, "model.onnx", flag, value]
    if flag != "--dim":
        argv += ["--dim", "N=8"]
    if command == "plan":
        argv += ["--devices", "4", "--format", "json"] if flag != "--devices" else ["--format", "json"]
    outcome = run_in_process(Case("flags", "hypothesis", argv, {"model.onnx": _bytes(tiny_chain())}), folder)
    assert outcome.problem is None, (argv, outcome.problem)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512))
def test_any_bytes_as_a_model_are_one_sentence(data, folder):
    outcome = run_in_process(Case("model_bytes", "hypothesis", ["plan", "model.onnx"], {"model.onnx": data}), folder)
    assert outcome.code == 1 and outcome.problem is None, outcome.problem
