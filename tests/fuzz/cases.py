"""Bad input for the command line, generated: mutated models, flags, cost models and plan files.

Each `Case` is an ``autopar`` command line plus the files it reads. `run_in_process` runs one
through `autopar.cli.main` and judges it: exit 0 with a finite plan, or exit 1 / 2 with one line
on stderr, never a traceback, an internal error (exit 3), a Python warning, or a hang. The CI
test (`tests/fuzz/test_fuzz.py`) runs a few hundred seeded cases; `bench/fuzz.py` runs thousands,
each in its own process so it can also measure memory and kill a hang.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import signal
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from autopar.cost.profile import profiles_dir
from models.transformer import build_transformer

CATEGORIES = ("model_bytes", "model_structure", "flags", "cost_model", "plan_file")


@dataclass
class Case:
    """One command line and the files it needs (written into the working folder before it runs)."""

    category: str
    label: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Outcome:
    case: Case
    code: int
    stdout: str
    stderr: str
    problem: str | None  # None: the behaviour the product promises


# --- seed material -------------------------------------------------------------------------------


def tiny_chain() -> onnx.ModelProto:
    """Z = relu(X @ W1) @ W2 with a bias: small enough to plan in milliseconds."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["H"], name="mm1"),
        helper.make_node("Add", ["H", "b1"], ["Hb"], name="bias1"),
        helper.make_node("Relu", ["Hb"], ["R"], name="relu"),
        helper.make_node("MatMul", ["R", "W2"], ["Z"], name="mm2"),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "W2"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["N", 8])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def tiny_gpt() -> onnx.ModelProto:
    return build_transformer("gpt", layers=1, hidden=32, heads=2, seq=8, vocab=64, batch=2)


SEEDS: dict[str, Callable[[], onnx.ModelProto]] = {"chain": tiny_chain, "gpt": tiny_gpt}
PLAN_ARGS = {"chain": ["--dim", "N=8"], "gpt": []}


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def _plan(model_name: str, devices: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    return ["plan", "model.onnx", "--devices", str(devices), "--format", "json", *PLAN_ARGS[model_name], *extra]


# --- generators, one per category ------------------------------------------------------------------


def model_bytes_cases(rng: random.Random, count: int) -> Iterator[Case]:
    """Byte flips, truncations and appended garbage of a serialised model."""
    for index in range(count):
        name = rng.choice(sorted(SEEDS))
        data = bytearray(_bytes(SEEDS[name]()))
        kind = rng.choice(["flip", "flip", "truncate", "append", "zero_run"])
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                position = rng.randrange(len(data))
                data[position] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind == "append":
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        else:
            start = rng.randrange(len(data))
            data[start : start + rng.randint(1, 32)] = bytes(min(32, len(data) - start))
        yield Case("model_bytes", f"{name}-{kind}-{index}", _plan(name), {"model.onnx": bytes(data)})


def _mutate_structure(model: onnx.ModelProto, rng: random.Random) -> str:
    """One structural mutation through the onnx API; returns its name."""
    graph = model.graph
    kind = rng.choice(
        [
            "drop_node", "duplicate_node_name", "bad_attribute", "attribute_type", "input_dim", "input_type",
            "dangling_output", "opset", "swap_nodes", "cycle", "initializer_dtype", "drop_initializer",
            "unknown_op", "empty_graph", "rename_input", "huge_dim",
        ]
    )  # fmt: skip
    nodes = list(graph.node)
    if not nodes:
        return "none"  # an earlier mutation emptied the graph
    node = rng.choice(nodes)
    if kind == "drop_node":
        graph.node.remove(node)
    elif kind == "duplicate_node_name":
        other = rng.choice(nodes)
        node.name = other.name
    elif kind == "bad_attribute":
        node.attribute.append(helper.make_attribute("autopar_fuzz", rng.choice([3, 2.5, "x", [1, 2]])))
    elif kind == "attribute_type":
        if node.attribute:
            attribute = rng.choice(list(node.attribute))
            replacement = helper.make_attribute(attribute.name, rng.choice([[1, 2], "text", 1.5, 7]))
            node.attribute.remove(attribute)
            node.attribute.append(replacement)
    elif kind in ("input_dim", "huge_dim"):
        vi = rng.choice(list(graph.input))
        dims = vi.type.tensor_type.shape.dim
        if dims:
            dim = dims[rng.randrange(len(dims))]
            dim.Clear()
            dim.dim_value = rng.choice([0, -5, -1]) if kind == "input_dim" else rng.choice([2**31, 2**40, 2**62])
    elif kind == "input_type":
        vi = rng.choice(list(graph.input))
        vi.type.tensor_type.elem_type = rng.choice([TensorProto.STRING, 0, TensorProto.COMPLEX64, 99])
    elif kind == "dangling_output":
        graph.output.append(helper.make_tensor_value_info("autopar_fuzz_out", TensorProto.FLOAT, [1]))
    elif kind == "opset":
        model.opset_import[0].version = rng.choice([1, 5, 99, 0, -3])
    elif kind == "swap_nodes":
        i, j = rng.randrange(len(nodes)), rng.randrange(len(nodes))
        nodes[i], nodes[j] = nodes[j], nodes[i]
        del graph.node[:]
        graph.node.extend(nodes)
    elif kind == "cycle":
        last = nodes[-1]
        node.input[0] = last.output[0]
    elif kind == "initializer_dtype":
        if graph.initializer:
            init = rng.choice(list(graph.initializer))
            array = numpy_helper.to_array(init)
            replacement = numpy_helper.from_array(array.astype(rng.choice([np.int32, np.float64, np.int8])), init.name)
            init.CopyFrom(replacement)
    elif kind == "drop_initializer":
        if graph.initializer:
            graph.initializer.remove(rng.choice(list(graph.initializer)))
    elif kind == "unknown_op":
        node.op_type = rng.choice(["NoSuchOp", "Conv", "Loop", "MatMulInteger"])
    elif kind == "empty_graph":
        del graph.node[:]
    elif kind == "rename_input":
        node.input[rng.randrange(len(node.input))] = "autopar_fuzz_missing"
    return kind


def model_structure_cases(rng: random.Random, count: int) -> Iterator[Case]:
    for index in range(count):
        name = rng.choice(sorted(SEEDS))
        model = SEEDS[name]()
        kinds = [_mutate_structure(model, rng) for _ in range(rng.choice([1, 1, 2]))]
        yield Case("model_structure", f"{name}-{'+'.join(kinds)}-{index}", _plan(name), {"model.onnx": _bytes(model)})


_BAD_FLAGS: list[list[str]] = [
    ["--devices", "0"], ["--devices", "-8"], ["--devices", "6"], ["--devices", "3.0"], ["--devices", "1e3"],
    ["--devices", "131072"], ["--devices", str(2**63)], ["--devices", ""], ["--batch", "0"], ["--batch", "-1"],
    ["--batch", str(2**63)], ["--batch", "1099511627776"], ["--batch", "x"], ["--dim", "N"], ["--dim", "=3"],
    ["--dim", "N=0"], ["--dim", f"N={2**63}"], ["--dim", "N=abc"], ["--dim", "Q=4"], ["--mode", "hybrid"],
    ["--precision", "fp8"], ["--search", "beam"], ["--format", "xml"], ["--cost-model", "nosuch"],
    ["--cost-model", "/nonexistent/x.toml"], ["--out", "/nonexistent/dir/plan.json"], ["--out", "."],
    ["--no-such-flag"], ["--devices"], ["--micro-batches", "0"], ["--micro-batches", "65"], ["--micro-batches", "3"],
    ["--micro-batches", "x"], ["--frozen", "nosuch*"], ["--frozen", ""], ["--rank-table", "/nonexistent/rank.json"],
    ["--rank-table", "model.onnx"], ["--no-overlap", "--devices", "5"],
]  # fmt: skip


def flag_cases(rng: random.Random, count: int) -> Iterator[Case]:
    seed = _bytes(tiny_chain())
    for index in range(count):
        picks = [flag for flags in rng.sample(_BAD_FLAGS, rng.choice([1, 1, 2])) for flag in flags]
        command = rng.choice(["plan", "plan", "verify", "inspect"])
        argv = [command, "model.onnx", *picks]
        if command == "verify" and rng.random() < 0.5:
            argv += ["--seed", rng.choice(["-1", str(2**40), "x", "7"])]
        yield Case("flags", f"{command}-{index}", argv, {"model.onnx": seed})


def _profile_text(data: dict) -> str:
    """A small TOML writer for profile dicts (tables of {value, source} pairs and [[links]])."""

    def scalar(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            if math.isinf(value):
                return "inf" if value > 0 else "-inf"
        return json.dumps(value)

    def inline(value: object) -> str:
        if isinstance(value, dict):
            return "{ " + ", ".join(f"{key} = {inline(item)}" for key, item in value.items()) + " }"
        return scalar(value)

    lines = [f"{key} = {inline(value)}" for key, value in data.items() if not isinstance(value, (dict, list))]
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{name} = {inline(item)}" for name, item in value.items()]
    for level in data.get("links", []):
        lines.append("[[links]]")
        lines += [f"{name} = {inline(item)}" for name, item in level.items()]
    return "\n".join(lines) + "\n"


def cost_model_cases(rng: random.Random, count: int) -> Iterator[Case]:
    base = tomllib.loads((profiles_dir() / "ascend910.toml").read_text(encoding="utf-8"))
    seed = _bytes(tiny_chain())
    bad_values: list[object] = [
        math.inf,
        -math.inf,
        math.nan,
        -1.0,
        0.0,
        1e-300,
        1.5,
        1e308,
        "fast",
        True,
        [1, 2],
        3,
    ]
    for index in range(count):
        data = copy.deepcopy(base)
        kind = rng.choice(["value", "value", "plain_number", "drop", "bits", "garbage", "no_links"])
        if kind in ("value", "plain_number", "drop"):
            section = rng.choice(["compute", "training", "links"])
            table = rng.choice(data["links"]) if section == "links" else data[section]
            key = rng.choice([k for k in table if k not in ("name", "bits")])
            if kind == "value":
                table[key] = {"value": rng.choice(bad_values), "source": "fuzz"}
            elif kind == "plain_number":
                table[key] = rng.choice([1.0, 5, 2e9])
            else:
                del table[key]
        elif kind == "bits":
            rng.choice(data["links"])["bits"] = rng.choice([0, -1, 100, 2.5, "two"])
        elif kind == "no_links":
            data["links"] = []
        text = "name = [unclosed\n" if kind == "garbage" else _profile_text(data)
        argv = ["plan", "model.onnx", "--devices", "4", "--dim", "N=8", "--cost-model", "profile.toml"]
        yield Case("cost_model", f"{kind}-{index}", argv, {"model.onnx": seed, "profile.toml": text.encode()})


def _valid_plan(model: onnx.ModelProto, devices: int, args: list[str]) -> dict:
    import autopar

    dims = dict(arg.split("=") for arg in args[1::2]) if args else {}
    plan = autopar.plan(model, devices=devices, dims={k: int(v) for k, v in dims.items()})
    return plan.to_dict()


def _mutate_plan(data: object, rng: random.Random) -> object:
    """Replace, delete or retype one random node of a JSON tree."""
    if not isinstance(data, (dict, list)) or not data or rng.random() < 0.15:
        return rng.choice([None, 4, -1, 2.5, "garbage", [], {}, [[3]], True, 2**70])
    if isinstance(data, dict):
        key = rng.choice(sorted(data))
        if rng.random() < 0.2:
            del data[key]
        else:
            data[key] = _mutate_plan(data[key], rng)
        return data
    position = rng.randrange(len(data))
    data[position] = _mutate_plan(data[position], rng)
    return data


def plan_file_cases(rng: random.Random, count: int) -> Iterator[Case]:
    model = tiny_chain()
    valid = _valid_plan(model, 4, PLAN_ARGS["chain"])
    for index in range(count):
        kind = rng.choice(["mutate", "mutate", "mutate", "nested", "not_json", "devices", "strategy", "step"])
        data: object = copy.deepcopy(valid)
        if kind == "mutate":
            data = _mutate_plan(data, rng)
            text = json.dumps(data)
        elif kind == "nested":
            depth = rng.choice([1000, 100_000])
            text = "[" * depth + "]" * depth
        elif kind == "not_json":
            text = rng.choice(["", "{", "plan", '{"schema": NaN}', "\x00\x01"])
        elif kind == "devices":
            assert isinstance(data, dict)
            data["devices"] = rng.choice([8, 2, 0, -4])
            text = json.dumps(data)
        elif kind == "strategy":
            assert isinstance(data, dict)
            op = rng.choice(data["ops"])
            op["strategy"] = rng.choice([[[3, 1]], [[8, 1], [1, 1]], [[1]], [[2, 2], [2, 2], [2]], [[0, 1], [1, 1]]])
            text = json.dumps(data)
        else:
            assert isinstance(data, dict)
            steps = [s for r in data["redistributions"] for s in r["steps"]] or [None]
            step = rng.choice(steps)
            if step is not None:
                step[rng.choice(["bits", "dim", "concat_dim", "collective", "bytes"])] = rng.choice(
                    [[9], [0, 0], 7, -1, "Broadcast", [], 0]
                )
            text = json.dumps(data)
        argv = ["verify", "model.onnx", "--devices", "4", "--dim", "N=8", "--plan", "plan.json"]
        yield Case("plan_file", f"{kind}-{index}", argv, {"model.onnx": _bytes(model), "plan.json": text.encode()})


GENERATORS: dict[str, Callable[[random.Random, int], Iterator[Case]]] = {
    "model_bytes": model_bytes_cases,
    "model_structure": model_structure_cases,
    "flags": flag_cases,
    "cost_model": cost_model_cases,
    "plan_file": plan_file_cases,
}


def generate(seed: int, per_category: int) -> list[Case]:
    rng = random.Random(seed)
    return [case for name in CATEGORIES for case in GENERATORS[name](rng, per_category)]


# --- judging ------------------------------------------------------------------------------------


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"non-finite number {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def judge(case: Case, code: int, stdout: str, stderr: str) -> str | None:
    """None when the outcome is one the product promises; otherwise what is wrong."""
    if "Traceback" in stderr or "internal error" in stderr:
        return f"traceback or internal error: {stderr.strip()[-300:]}"
    if code not in (0, 1, 2):
        return f"exit {code}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("autopar: warning:")]
    if code == 0:
        if errors:
            return f"exit 0 but stderr says: {errors[0][:200]}"
        if case.argv[0] == "plan" and "--format" in case.argv and "json" in case.argv and "--out" not in case.argv:
            try:
                plan = _strict_json(stdout)
            except ValueError as exc:
                return f"exit 0 but the plan is not strict JSON: {exc}"
            return _wrong_plan(plan)
        return None
    if len(errors) != 1 or not errors[0].startswith("autopar: error:"):
        return f"exit {code} without exactly one 'autopar: error:' line: {stderr.strip()[:300]!r}"
    return None


def _wrong_plan(plan: object) -> str | None:
    if not isinstance(plan, dict):
        return "the plan is not an object"
    totals = plan["totals"]
    figures = [plan["objective_s"], *(v for v in totals.values() if not isinstance(v, dict))]
    figures += list(totals["memory_breakdown"].values())
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= -1e-12 for v in figures):
        return f"a plan figure is negative or not finite: {figures}"
    devices = plan["devices"]
    for op in plan["ops"]:
        for entry in op["strategy"]:
            if any(f < 1 or f & (f - 1) for f in entry) or math.prod(entry) > devices:
                return f"operator {op['name']!r} has an invalid strategy {op['strategy']}"
    return None


class _Timeout(Exception):
    pass


def run_in_process(case: Case, folder: Path, timeout_s: int = 60) -> Outcome:
    """Run one case through `autopar.cli.main` inside ``folder``, with an alarm for hangs."""
    import os
    import warnings

    from autopar.cli import main

    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    out, err = io.StringIO(), io.StringIO()

    def alarm(signum: int, frame: object) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout_s)
    here = os.getcwd()
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")  # a Python warning must reach stderr, where judge sees it
            try:
                code = main(case.argv)
            except SystemExit as exc:  # argparse's exits
                code = exc.code if isinstance(exc.code, int) else 1
    except _Timeout:
        return Outcome(case, -1, out.getvalue(), err.getvalue(), f"still running after {timeout_s} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(here)
        for name in case.files:
            (folder / name).unlink(missing_ok=True)
    return Outcome(case, code, out.getvalue(), err.getvalue(), judge(case, code, out.getvalue(), err.getvalue()))
