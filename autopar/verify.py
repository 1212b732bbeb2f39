"""SPMD verification: run a plan on N virtual devices and compare with the single-device model.

Random weights (where the file has none) and inputs (labels in range) are materialised once.
The reference is the original graph run by onnxruntime on one device. The plan then runs on N
virtual ranks: each rank holds only its shards, computes every operator on its local shards
(onnxruntime on the local shapes, with the few local adjustments a sharded operator needs),
and every collective the plan lists is carried out on the ranks' buffers by `autopar.spmd`.
Nothing is computed from a full tensor behind the plan's back.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.layout import Layout
from autopar.plan import Plan
from autopar.redistribute import Step, apply_steps
from autopar.search.driver import SearchResult
from autopar.search.problem import SearchProblem
from autopar.spmd import assemble, run_step, shard

OUTPUT_CONSUMER = "<graph output>"


@dataclass
class VerifyReport:
    """What a verification found: per-output errors and the collectives carried out."""

    ok: bool
    devices: int
    outputs: dict[str, dict[str, float | bool]]
    executed: dict[str, dict[str, int]]
    planned: dict[str, dict[str, int]]
    problems: list[str] = field(default_factory=list)
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "devices": self.devices, "outputs": self.outputs, "collectives_executed": self.executed,
                "collectives_planned": self.planned, "problems": self.problems, "time_s": round(self.time_s, 3)}


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise AutoparError("Verification needs onnxruntime: pip install 'autopar[verify]'.") from None
    return onnxruntime


# --- materialising values -----------------------------------------------------------------------


def materialise(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Full values of every parameter, data input and constant (random where the file has none)."""
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    statistics = {op.inputs[4] for op in graph.ops if op.op_type == "BatchNormalization" and len(op.inputs) > 4}
    scales = {op.inputs[1] for op in graph.ops if op.op_type == "BatchNormalization"}
    for name in sorted(graph.tensors):
        info = graph.tensors[name]
        if info.kind == "activation":
            continue
        if info.value is not None:
            values[name] = np.asarray(info.value)
            continue
        dtype = np.dtype(info.dtype)
        if info.kind == "parameter":
            if name in statistics or name in scales:
                values[name] = rng.uniform(0.5, 1.5, info.shape).astype(dtype)
            else:
                fan_in = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else max(info.shape[0], 1)
                values[name] = (rng.standard_normal(info.shape) / np.sqrt(fan_in)).astype(dtype)
        elif info.is_float:
            values[name] = rng.standard_normal(info.shape).astype(dtype)
        else:
            values[name] = rng.integers(0, _index_range(graph, name), info.shape).astype(dtype)
    return values


def _index_range(graph: Graph, name: str) -> int:
    """Integer inputs must be valid indices for the operators that read them (class labels, token ids)."""
    limits = []
    for consumer in graph.consumers.get(name, []):
        op = graph.op(consumer)
        slots = [slot for slot, inp in enumerate(op.inputs) if inp == name]
        if op.op_type == "OneHot" and 0 in slots:
            depth = graph.tensor(op.inputs[1]).value
            if depth is not None:
                limits.append(int(np.asarray(depth).reshape(-1)[0]))
        elif op.op_type in ("Gather", "GatherElements") and 1 in slots:
            data_shape = graph.tensor(op.inputs[0]).shape
            limits.append(data_shape[int(op.attrs.get("axis", 0)) % len(data_shape)])
        elif op.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and 1 in slots:
            limits.append(graph.tensor(op.inputs[0]).shape[1])
    return max(min(limits), 1) if limits else 2


def reference_outputs(graph: Graph, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the original graph on one device with onnxruntime, elided weights replaced by ``values``."""
    ort = _ort()
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    params = {p.name for p in graph.parameters}
    kept = [node for node in model.graph.node if not (set(node.output) & params)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    # weights kept in external data files are never read: the run uses the materialised ones
    external = [init for init in model.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    for init in external:
        model.graph.initializer.remove(init)
    existing = {init.name for init in model.graph.initializer}
    for name in sorted((params | {init.name for init in external if init.name in values}) - existing):
        model.graph.initializer.append(numpy_helper.from_array(values[name], name))
    session = _session(ort, model)
    feeds = {name: values[name] for name in graph.inputs}
    names = [o for o in graph.outputs]
    return dict(zip(names, session.run(names, feeds)))


def _session(ort, model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep fp32 arithmetic as written
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


# --- the plan as verify reads it ------------------------------------------------------------------


def _plan_parts(problem: SearchProblem, plan: Plan | Mapping[str, Any]) -> tuple[list[int], dict, list[dict]]:
    """(candidate choice, redistribution entries by (tensor, producer, consumer), all entries)."""
    from autopar.api import choice_for

    if isinstance(plan, Plan):
        choice = plan.choice
        entries = plan.to_dict()["redistributions"]
    elif "schema" in plan:
        if plan.get("schema") != "autopar.plan/1":
            raise AutoparError(f"Unknown plan schema {plan.get('schema')!r}; expected 'autopar.plan/1'.")
        if plan.get("devices") != problem.num_devices:
            raise AutoparError(f"The plan is for {plan.get('devices')} devices but verification runs on"
                               f" {problem.num_devices}.")
        strategies = {op["name"]: tuple(tuple(s) for s in op["strategy"]) for op in plan["ops"]}
        choice = choice_for(problem, strategies)
        entries = list(plan.get("redistributions", []))
    else:
        choice = choice_for(problem, plan)  # a plain {op: strategy} mapping
        entries = Plan.lower(problem, SearchResult(choice, "given", 0.0), "given").to_dict()["redistributions"]
    by_key = {(e["tensor"], e["producer"], e["consumer"]): e for e in entries}
    return choice, by_key, entries


def _tally(steps: list[Step], into: Counter, nbytes: Counter) -> None:
    for step in steps:
        into[step.kind] += 1
        nbytes[step.kind] += step.nbytes


# --- running the plan on virtual devices -----------------------------------------------------------


class _Runner:
    """Executes one plan rank by rank; buffers map a tensor to (layout, per-rank arrays)."""

    def __init__(self, problem: SearchProblem, choice: list[int], entries: dict, values: Mapping[str, np.ndarray]):
        self.problem, self.choice, self.entries, self.values = problem, choice, entries, values
        self.mesh_bits = problem.mesh_bits
        self.ranks = problem.num_devices
        self.buffers: dict[tuple[str, str], tuple[Layout, list[np.ndarray]]] = {}
        self.executed: Counter = Counter()
        self.executed_bytes: Counter = Counter()
        self.problems: list[str] = []
        self.ort = _ort()

    def run(self) -> None:
        last_read = {name: node for node, rule in enumerate(self.problem.rules) for name in rule.op.inputs if name}
        keep = set(self.problem.graph.outputs)
        for node, rule in enumerate(self.problem.rules):
            inputs = [self._input(node, slot) for slot in range(len(rule.op.inputs))]
            outputs = self._compute(node, inputs)
            for name, layout, per_rank in zip(rule.op.outputs, self.problem.rules[node].candidate_layouts(
                    self.choice[node])[1], outputs):
                if name:
                    self.buffers[(name, rule.op.name)] = (layout, per_rank)
            for name in set(rule.op.inputs):  # free what no later operator reads (large models, big batches)
                if name and last_read[name] == node and name not in keep:
                    for key in [key for key in self.buffers if key[0] == name]:
                        del self.buffers[key]

    def _redistribute(self, tensor: str, producer: str, consumer: str, src: Layout, dst: Layout,
                      per_rank: list[np.ndarray]) -> list[np.ndarray]:
        entry = self.entries.get((tensor, producer, consumer))
        steps = [Step.from_dict(s) for s in entry["steps"]] if entry else []
        try:
            reached = apply_steps(src, steps)
        except ValueError as exc:
            raise _PlanBroken(f"the plan's redistribution of {tensor!r} from {producer!r} to {consumer!r} is"
                              f" malformed: {exc}") from None
        if reached != dst:
            raise _PlanBroken(f"the plan's redistribution of {tensor!r} from {producer!r} to {consumer!r} leaves it"
                              f" in layout {reached.describe()} but {consumer!r} needs {dst.describe()}"
                              " (a collective is missing or wrong)")
        for step in steps:
            per_rank = run_step(per_rank, step)
        _tally(steps, self.executed, self.executed_bytes)
        return per_rank

    def _input(self, node: int, slot: int) -> list[np.ndarray] | None:
        problem = self.problem
        rule = problem.rules[node]
        name = rule.op.inputs[slot]
        if not name:
            return None
        layout = rule.candidate_layouts(self.choice[node])[0][slot]
        info = problem.graph.tensor(name)
        if info.kind == "constant" or problem.owner.get(name) == (node, slot):
            per_rank = shard(self.values[name], layout, self.mesh_bits)  # stored or loaded as this op wants
            if info.kind != "constant":
                self.buffers[(name, rule.op.name)] = (layout, per_rank)
            return per_rank
        if info.kind == "activation":
            source = problem.graph.producer[name]
        else:
            source = problem.rules[problem.owner[name][0]].op.name
        src_layout, per_rank = self.buffers[(name, source)]
        return self._redistribute(name, source, rule.op.name, src_layout, layout, per_rank)

    def _compute(self, node: int, inputs: list[list[np.ndarray] | None]) -> list[list[np.ndarray]]:
        from autopar.local_ops import run_local

        rule = self.problem.rules[node]
        return run_local(self.ort, self.problem, rule, self.choice[node], inputs, self.ranks)

    def output(self, name: str) -> np.ndarray:
        producer = self.problem.graph.producer[name]
        layout, per_rank = self.buffers[(name, producer)]
        if layout.partial:
            target = Layout(layout.dims)
            per_rank = self._redistribute(name, producer, OUTPUT_CONSUMER, layout, target, per_rank)
            layout = target
        return assemble(per_rank, layout, self.problem.graph.tensor(name).shape)


class _PlanBroken(Exception):
    pass


def verify_problem(problem: SearchProblem, plan: Plan | Mapping[str, Any], seed: int = 0, rtol: float = 1e-4,
                   atol: float = 1e-5) -> VerifyReport:
    """Verify a plan (a `Plan`, a plan dict as JSON gives it, or {op: strategy}) for ``problem``."""
    start = time.perf_counter()
    choice, by_key, entries = _plan_parts(problem, plan)
    planned, planned_bytes = Counter(), Counter()
    for entry in entries:
        _tally([Step.from_dict(s) for s in entry["steps"]], planned, planned_bytes)
    values = materialise(problem.graph, seed)
    reference = reference_outputs(problem.graph, values)
    runner = _Runner(problem, choice, by_key, values)
    outputs: dict[str, dict[str, float | bool]] = {}
    problems: list[str] = []
    try:
        runner.run()
        for name, expected in reference.items():
            got = runner.output(name)
            error = np.abs(got.astype(np.float64) - expected.astype(np.float64))
            magnitude = float(np.abs(expected.astype(np.float64)).max(initial=0.0))
            worst_error = float(error.max(initial=0.0))
            # norm-wise: a sharded sum adds the same terms in another order, and its rounding
            # error scales with the tensor's magnitude, not with an element that cancels to ~0
            close = bool(np.isfinite(worst_error)) and worst_error <= atol + rtol * magnitude
            outputs[name] = {"max_abs_error": worst_error,
                             "max_rel_error": worst_error / magnitude if magnitude else worst_error,
                             "ok": close}
            if not close:
                worst = np.unravel_index(int(np.argmax(error)), error.shape) if error.size else ()
                problems.append(f"output {name!r} differs from the single-device reference: max abs error"
                                f" {worst_error:.3g} against a largest magnitude of {magnitude:.3g}"
                                f" (worst at index {tuple(int(i) for i in worst)})")
    except _PlanBroken as exc:
        problems.append(str(exc))
    executed = {k: {"count": runner.executed[k], "bytes": runner.executed_bytes[k]} for k in sorted(runner.executed)}
    planned_dict = {k: {"count": planned[k], "bytes": planned_bytes[k]} for k in sorted(planned)}
    if not problems and executed != planned_dict:
        problems.append(f"the collectives executed {executed} differ from those the plan lists {planned_dict}")
    return VerifyReport(ok=not problems, devices=problem.num_devices, outputs=outputs, executed=executed,
                        planned=planned_dict, problems=problems, time_s=time.perf_counter() - start)
