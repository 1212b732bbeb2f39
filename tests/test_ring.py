"""Context parallelism as ring attention runs it: what a fused attention kernel hides of the keys and values
it gathers, charged by the search and listed by the plan alike."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import autopar
from autopar.layout import Layout
from autopar.lowering import GRAPH_OUTPUT, Plan
from autopar.search import ring
from autopar.search.driver import SearchResult

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def llama():
    """A Llama export on 8 H100s, whose profile has a fused attention kernel."""
    return autopar.build(DATA / "torch_llama_dynamo.onnx", 8, cost_model="h100")


def _ring_assignment(problem, pick: random.Random) -> tuple[int, ...]:
    """A random assignment whose attention products read their keys and values round a ring where they can."""
    choice = [pick.randrange(len(rule.candidates)) for rule in problem.rules]
    for node, rule in enumerate(problem.rules):
        if rule.op.name in problem.fused and problem.fused[rule.op.name].role in ("scores", "values"):
            ring_candidates = np.flatnonzero(ring.reads_round(problem, node))
            if len(ring_candidates):
                choice[node] = pick.choice(ring_candidates.tolist())
    return tuple(choice)


def test_only_the_products_of_a_fused_kernel_read_round_a_ring(llama):
    roles = {name: part.role for name, part in llama.fused.items()}
    assert sorted(set(roles.values())) == ["inner", "scores", "values"]
    readers = {llama.rules[use.dst_node].op.name for use in llama.uses if ring.reads_through(llama, use)}
    assert readers == {name for name, role in roles.items() if role in ("scores", "values")}
    plain = autopar.build(DATA / "torch_llama_dynamo.onnx", 8)  # ascend910: no fused kernel
    assert not any(ring.reads_through(plain, use) for use in plain.uses)


def test_a_ring_window_is_the_product_s_forward_and_backward_where_it_splits_the_queries_and_reads_the_keys_whole(
    llama,
):
    for node, rule in enumerate(llama.rules):
        part = llama.fused.get(rule.op.name)
        if part is None or part.role not in ("scores", "values"):
            continue
        forward, backward = ring.windows(llama, node, llama.node_compute[node], ring.reads_round(llama, node))
        for candidate in range(len(rule.candidates)):
            queries, keys = rule.candidate_layouts(candidate)[0][:2]
            read_round = bool(queries.dims[-2]) and not keys.dims[-1 if part.role == "scores" else -2]
            whole = float(llama.node_compute[node][candidate])
            assert forward[candidate] == pytest.approx(whole / llama.work_multiple(node) if read_round else 0.0)
            assert forward[candidate] + backward[candidate] == pytest.approx(whole if read_round else 0.0)
        assert forward.any()


def test_the_search_charges_what_the_kernel_does_not_hide_as_the_plan_lists_it(llama):
    """For random assignments with the attention products reading round a ring: the forward redistributions
    and the gradients' ways back the plan lists, less what it says runs under the kernels, cost what the
    search charged on the edges; each hidden share is at most its transfer and the product's compute."""
    pick = random.Random(0)
    hidden = 0.0
    for _ in range(6):
        choice = _ring_assignment(llama, pick)
        nodes = sum(float(llama.node_arrays(i)[0][c]) for i, c in enumerate(choice))
        charged = llama.objective(choice) - nodes
        data = Plan(llama, choice, SearchResult(choice, "given", 0.0), "model", "given", "h100", "mixed").file
        back = {(p.tensor, p.producer, p.consumer): p.seconds for p in data.gradients}
        listed = sum(r.seconds - (r.hidden_s or 0.0) for r in data.redistributions if r.consumer != GRAPH_OUTPUT)
        listed += sum(path.seconds for path in data.gradients if path.carries is None)
        assert listed == pytest.approx(charged, rel=1e-9, abs=1e-15)
        for red in data.redistributions:
            if red.hidden_s:
                assert red.hidden_s <= red.seconds + back.get(red.key, 0.0) + 1e-15
                assert [step.collective for step in red.steps] == ["AllGather"]
                hidden += red.hidden_s
    assert hidden > 0


def test_only_the_sequence_gathered_round_the_ring_runs_under_the_kernel():
    assert ring.passed_round(Layout(((2,), (), (0, 1), ())), Layout(((2,), (), (), ())), -2)
    assert not ring.passed_round(Layout(((2,), (), (0, 1), ())), Layout(((), (), (), ())), -2)  # the batch too
    assert not ring.passed_round(Layout(((), (0,), (), ())), Layout(((0,), (), (), ())), -2)  # an AllToAll (Ulysses)
    assert not ring.passed_round(Layout(((), (), (), ()), (0,)), Layout(((), (), (), ())), -2)  # an AllReduce
    assert not ring.passed_round(Layout(((), (), (0,), ())), Layout(((), (), (0,), ())), -2)  # already there
