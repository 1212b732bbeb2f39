"""Lowering: a chosen candidate per operator becomes a `Plan` people and tools can read.

The plan lists every operator's strategy and layouts, every redistribution the dataflow
needs (with its collectives, group sizes, bytes and seconds), the gradient synchronisation
of each parameter, and totals. Its JSON form is versioned by ``schema`` ("autopar.plan/1").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from autopar.layout import Layout
from autopar.redistribute import BACKWARD_DUAL
from autopar.search.driver import SearchResult, data_parallel_choice
from autopar.search.problem import SearchProblem, backward_passes

SCHEMA = "autopar.plan/1"


def _round(value: float) -> float:
    """Seconds and ratios printed with 12 significant digits: stable across platforms' last bits."""
    return float(f"{value:.12g}")


@dataclass
class Plan:
    """The chosen whole: a strategy per operator plus everything it implies."""

    problem: SearchProblem = field(repr=False)
    choice: list[int] = field(repr=False)
    search: SearchResult = field(repr=False)
    model_name: str
    mode: str
    cost_model: str
    precision: str

    @classmethod
    def lower(cls, problem: SearchProblem, result: SearchResult, mode: str) -> "Plan":
        """The plan of one search result on one problem."""
        return cls(problem, result.choice, result, problem.graph.name, mode, problem.cost.profile.name,
                   problem.cost.precision)

    @property
    def devices(self) -> int:
        return self.problem.num_devices

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Operator name -> MindSpore-style in_strategy (one split tuple per input)."""
        return {rule.op.name: rule.in_strategy(rule.candidates[c]) for rule, c in zip(self.problem.rules, self.choice)}

    @property
    def objective(self) -> float:
        """The searched objective: predicted training step time in seconds."""
        return self.problem.objective(self.choice)

    @property
    def memory_per_device(self) -> float:
        return self.problem.memory(self.choice)

    @property
    def fallback_ops(self) -> list[str]:
        return [rule.op.name for rule in self.problem.rules if rule.spec.fallback]

    def fallback_summary(self) -> str:
        """One sentence naming the operators kept replicated for want of a rule."""
        rules = [rule for rule in self.problem.rules if rule.spec.fallback]
        named = ", ".join(f"{rule.op.name} ({rule.op.op_type})" for rule in rules[:5])
        more = f" and {len(rules) - 5} more" if len(rules) > 5 else ""
        return (f"{len(rules)} operator(s) have no strategy rule and are kept replicated with their inputs gathered:"
                f" {named}{more}.")

    @property
    def data_parallel_objective(self) -> float:
        return self.problem.objective(data_parallel_choice(self.problem))

    # --- lowering -------------------------------------------------------------------------

    def layouts(self, node: int) -> tuple[list[Layout | None], list[Layout | None]]:
        return self.problem.rules[node].candidate_layouts(self.choice[node])

    def redistributions(self) -> list[dict[str, Any]]:
        """Every producer/consumer pair whose layouts differ, with its collective steps."""
        problem = self.problem
        found = []
        for use in problem.uses:
            src = problem.source_layout(use, self.choice[use.src_node])
            dst = self.layouts(use.dst_node)[0][use.dst_slot]
            if src == dst:
                continue
            found.append(self._redistribution_entry(use.tensor, problem.rules[use.src_node].op.name,
                                                    problem.rules[use.dst_node].op.name, src, dst))
        outputs = set(problem.graph.outputs)
        for node, rule in enumerate(problem.rules):
            for name, layout in zip(rule.op.outputs, self.layouts(node)[1]):
                if name in outputs and layout is not None and layout.partial:
                    found.append(self._redistribution_entry(name, rule.op.name, "<graph output>", layout,
                                                            Layout(layout.dims), backward=False))
        return found

    def _redistribution_entry(self, tensor: str, producer: str, consumer: str, src: Layout, dst: Layout,
                              backward: bool = True) -> dict[str, Any]:
        problem = self.problem
        steps, forward, backward_s = problem.redistribution(tensor, src, dst)
        cost = problem.cost
        entries = []
        for step in steps:
            entry = step.to_dict()
            entry["seconds"] = _round(cost.collective_time(step.kind, step.bits, step.nbytes))
            dual = BACKWARD_DUAL[step.kind] if backward and problem.requires_grad.get(tensor, False) else None
            entry["backward"] = dual
            entry["backward_seconds"] = _round(cost.collective_time(dual, step.bits, step.nbytes)) if dual else 0.0
            entries.append(entry)
        return {"tensor": tensor, "producer": producer, "consumer": consumer, "from": src.to_dict(),
                "to": dst.to_dict(), "steps": entries, "seconds": _round(forward + (backward_s if backward else 0.0))}

    def gradient_sync(self) -> list[dict[str, Any]]:
        """The AllReduce of each trainable parameter over the bits its gradient is partial on."""
        problem, cost = self.problem, self.problem.cost
        entries = []
        for name, (node, slot) in sorted(problem.owner.items(), key=lambda item: item[1]):
            info = problem.graph.tensor(name)
            if info.kind != "parameter" or not info.trainable:
                continue
            exps = problem.rules[node].candidates[self.choice[node]]
            layout = self.layouts(node)[0][slot]
            bits = problem.gradient_sync_bits(node, exps, slot)
            nbytes = layout.local_numel(info.shape) * cost.gradient_itemsize()
            entries.append({
                "parameter": name, "op": problem.rules[node].op.name, "layout": layout.to_dict(),
                "collective": "AllReduce" if bits else None, "bits": list(bits), "group_size": 1 << len(bits),
                "bytes": nbytes if bits else 0, "seconds": _round(cost.gradient_sync_time(bits, nbytes)) if bits else 0.0,
            })
        return entries

    def op_entries(self) -> list[dict[str, Any]]:
        problem = self.problem
        entries = []
        for node, (rule, c) in enumerate(zip(problem.rules, self.choice)):
            inputs, outputs = self.layouts(node)
            entries.append({
                "name": rule.op.name, "op_type": rule.op.op_type,
                "strategy": [list(s) for s in rule.in_strategy(rule.candidates[c])],
                "inputs": [{"tensor": t, "layout": lay.to_dict()} for t, lay in zip(rule.op.inputs, inputs) if t],
                "outputs": [{"tensor": t, "layout": lay.to_dict()} for t, lay in zip(rule.op.outputs, outputs) if t],
                "cost": {"compute_s": _round(float(problem.node_compute[node][c])),
                         "communication_s": _round(float(problem.node_sync[node][c])),
                         "memory_bytes": int(problem.node_memory[node][c])},
                "fallback": rule.spec.fallback,
            })
        return entries

    def totals(self) -> dict[str, Any]:
        problem = self.problem
        compute = sum(float(problem.node_compute[i][c]) for i, c in enumerate(self.choice))
        step = self.objective
        training_flops = self.training_flops()
        peak = problem.cost.peak_flops
        return {
            "step_time_s": _round(step),
            "compute_s": _round(compute),
            "communication_s": _round(step - compute),
            "memory_per_device_bytes": int(round(self.memory_per_device)),
            "memory_capacity_bytes": int(problem.cost.capacity),
            "training_flops": training_flops,
            "ideal_step_time_s": _round(training_flops / (self.devices * peak)),
            "data_parallel_step_time_s": _round(self.data_parallel_objective),
            "speedup_vs_data_parallel": _round(self.data_parallel_objective / step) if step > 0 else 1.0,
        }

    def training_flops(self) -> float:
        """Forward FLOPs plus the backward passes the cost model charges (inputs needing gradients)."""
        problem = self.problem
        total = 0.0
        for node, rule in enumerate(problem.rules):
            if rule.spec.op_class != "free":
                total += rule.op.flops * (1.0 + problem.cost.backward_factor * backward_passes(problem, node))
        return float(total)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plan (schema autopar.plan/1)."""
        return {
            "schema": SCHEMA,
            "model": self.model_name,
            "devices": self.devices,
            "mesh_bits": self.problem.mesh_bits,
            "cost_model": self.cost_model,
            "precision": self.precision,
            "mode": self.mode,
            "objective_s": _round(self.objective),
            "ops": self.op_entries(),
            "redistributions": self.redistributions(),
            "gradient_sync": self.gradient_sync(),
            "fallback_ops": self.fallback_ops,
            "totals": self.totals(),
            "search": {
                "algorithm": self.search.algorithm,
                "time_s": round(self.search.time_s, 4),
                "candidates": sum(len(rule.candidates) for rule in self.problem.rules),
                "operators": self.problem.size,
                "memory_multiplier": _round(self.search.lagrange_multiplier),
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _repr_html_(self) -> str:
        from autopar.report import plan_html

        return plan_html(self)
