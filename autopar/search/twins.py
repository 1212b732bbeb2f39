"""Twin branches: two copies of one branch between the same operators, searched as one, exactly.

A model may compute the same branch twice side by side. The interleaved form of rotary embedding
takes the even and the odd halves of a head (``x[..., 0]``, ``x[..., 1]``), multiplies each by cos
and by sin, and subtracts and adds the products: two Gathers both feed a Sub and an Add. The
elimination sees a diamond whose tables multiply four operators' layouts (3 billion entries for
Llama-3-8B on 64 devices), where the ``rotate_half`` form of the same rotation is a chain.

Two sets of operators S0 and S1 are *twins* under a one-to-one map s: S0 -> S1 when

- every operator u of S0 has the same candidates, node costs and memory as s(u);
- every cost table touching S1 is a table touching S0 with s applied: the same table and class
  maps at the same ends, operators outside S0 and S1 staying where they are;
- no table joins S0 and S1.

With every operator outside S0 and S1 fixed, the objective is then P(choice on S0) + P(choice on
S1 read through s) + a constant, for one function P: giving S1 the choice that minimises P on S0
(candidate for candidate, s(u) the same as u) loses nothing. So tying S1 to S0 keeps the optimum
exactly, and the search sees one branch with its costs counted twice. Tying twins can make new
ones (the rotary's Sub and Add are twins once its even and odd halves are one branch), so the
search runs again until it finds none. Ties between equally fast plans may resolve differently
from the untied search.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence

MAX_TWIN_OPERATORS = 64
"""Operators of one branch at most: twins are short branches beside each other, not whole models."""
MAX_SEED_GROUP = 16
"""Readers of one operator with the same table tried pairwise as the first pair of twins, at most."""
MAX_STEPS = 200_000
"""Pairs matched in one search in all, at most (a fraction of a second): past it, no more ties."""

_Entry = tuple[int, Hashable]  # (the operator at the other end, the table's key seen from this end)


def find_twins(
    size: int,
    edges: Sequence[tuple[int, int, Hashable]],
    node_keys: Sequence[Hashable | None],
    regions: Sequence[int],
) -> dict[int, int]:
    """Each operator tied to a twin -> the operator whose candidate it takes (never itself tied).

    ``edges`` are the cost tables as (source operator, destination operator, key), equal keys
    meaning the same table and class maps at both ends; ``node_keys`` equal for operators with the
    same candidates and node costs (None: never tied); ``regions`` the part of the search an
    operator is eliminated in (twins lie in one; negative: never tied).

    >>> # x -> a -> y and x -> b -> y, the two branches alike: b takes a's candidate
    >>> find_twins(4, [(0, 1, "in"), (0, 2, "in"), (1, 3, "out"), (2, 3, "out")], [0, 1, 1, 2], [0, 0, 0, 0])
    {2: 1}
    """
    root: dict[int, int] = {}
    current = [(src, dst, key) for src, dst, key in edges if src != dst]
    budget = [MAX_STEPS]
    # an operator standing for k tied ones carries k times their costs: alike only with another of k
    weight = [1] * size
    while True:
        keys = [None if key is None else (key, w) for key, w in zip(node_keys, weight)]
        found = _one_round(size, current, keys, regions, set(root), budget)
        if not found:
            break
        for twin, partner in found.items():
            root[twin] = partner
            weight[partner] += weight[twin]
        current = [(found.get(src, src), found.get(dst, dst), key) for src, dst, key in current]
    resolved: dict[int, int] = {}
    for twin in sorted(root):
        target = root[twin]
        while target in root:
            target = root[target]
        resolved[twin] = target
    return resolved


def _one_round(
    size: int,
    edges: list[tuple[int, int, Hashable]],
    node_keys: Sequence[Hashable | None],
    regions: Sequence[int],
    tied: set[int],
    budget: list[int],
) -> dict[int, int]:
    """Disjoint twins found on these tables: S1's operator -> S0's."""
    near: list[Counter[_Entry]] = [Counter() for _ in range(size)]
    for src, dst, key in edges:
        near[src][(dst, ("from", key))] += 1
        near[dst][(src, ("to", key))] += 1
    graph = _Graph(near, node_keys, regions)
    used: set[int] = set(tied)
    found: dict[int, int] = {}
    for hub in range(size):
        groups: dict[Hashable, list[int]] = {}
        for other, key in sorted(near[hub], key=lambda entry: entry[0]):
            if graph.allowed(other):
                groups.setdefault(key, []).append(other)
        for members in groups.values():
            members = sorted(set(members))[:MAX_SEED_GROUP]
            for i, u in enumerate(members):
                for v in members[i + 1 :]:
                    if budget[0] <= 0:
                        return found
                    if u in used or v in used or node_keys[u] != node_keys[v] or regions[u] != regions[v]:
                        continue
                    twins = graph.grow(u, v, budget)
                    if twins is not None:
                        found.update({s1: s0 for s0, s1 in twins.items()})
                        used.update(twins)
                        used.update(twins.values())
    return found


class _Graph:
    """The tables around each operator, for growing a pair of twins."""

    def __init__(self, near: list[Counter[_Entry]], node_keys: Sequence[Hashable | None], regions: Sequence[int]):
        self.near = near
        self.node_keys = node_keys
        self.regions = regions
        self.by_node: list[dict[int, Counter[Hashable]]] = []
        for entries in near:
            grouped: dict[int, Counter[Hashable]] = {}
            for (other, key), count in entries.items():
                grouped.setdefault(other, Counter())[key] += count
            self.by_node.append(grouped)

    def allowed(self, node: int) -> bool:
        return self.node_keys[node] is not None and self.regions[node] >= 0

    def grow(self, u: int, v: int, budget: list[int]) -> dict[int, int] | None:
        """The map s of twins S0 -> S1 that starts with u -> v, or None (depth first over the few choices)."""
        stack: list[tuple[dict[int, int], dict[int, int], frozenset[int], tuple[tuple[int, int], ...]]]
        stack = [({u: v}, {v: u}, frozenset(), ((u, v),))]
        while stack:
            forward, backward, outside, pending = stack.pop()
            budget[0] -= 1
            if budget[0] <= 0:
                return None
            if not pending:
                return forward
            a, b = pending[0]
            matched = self._match(a, b, forward, backward, outside)
            if matched is None:
                continue
            outside_after, needs, offers = matched
            options = list(self._pairings(needs, offers, self.regions[u]))
            for pairing in reversed(options):  # the first pairing is tried first
                grown, shrunk, more = dict(forward), dict(backward), list(pending[1:])
                for node, partner in pairing:
                    grown[node], shrunk[partner] = partner, node
                    more.append((node, partner))
                if len(grown) <= MAX_TWIN_OPERATORS:
                    stack.append((grown, shrunk, outside_after, tuple(more)))
        return None

    def _match(
        self, a: int, b: int, forward: dict[int, int], backward: dict[int, int], outside: frozenset[int]
    ) -> tuple[frozenset[int], list[tuple[int, Counter]], list[tuple[int, Counter]]] | None:
        """Check a's tables against b's: (operators now known to be outside, a's neighbours that need a
        partner, b's neighbours that can be one), or None where a and b cannot be twins."""
        near_a, near_b = self.by_node[a], self.by_node[b]
        now_outside = set(outside)
        needs: list[tuple[int, Counter]] = []
        for other, keys in near_a.items():
            if other in backward:  # a table between S0 and S1
                return None
            if other in forward:
                if near_b.get(forward[other]) != keys:
                    return None
            elif other in near_b or other in outside:  # read alike by both: outside both branches
                if near_b.get(other) != keys:
                    return None
                now_outside.add(other)
            else:
                needs.append((other, keys))
        offers: list[tuple[int, Counter]] = []
        for other, keys in near_b.items():
            if other in forward:
                return None
            if other in backward:
                if near_a.get(backward[other]) != keys:
                    return None
            elif other in now_outside:
                if near_a.get(other) != keys:
                    return None
            else:
                offers.append((other, keys))
        if len(needs) != len(offers):
            return None
        return frozenset(now_outside), needs, offers

    def _pairings(
        self, needs: list[tuple[int, Counter]], offers: list[tuple[int, Counter]], region: int
    ) -> Iterator[list[tuple[int, int]]]:
        """Every one-to-one pairing of a's unmatched neighbours with b's, alike in tables and costs."""
        if not needs:
            yield []
            return
        (node, keys), rest = needs[0], needs[1:]
        for index, (partner, partner_keys) in enumerate(offers):
            if partner_keys != keys or node == partner:
                continue
            if not (self.allowed(node) and self.allowed(partner)):
                continue
            if self.node_keys[node] != self.node_keys[partner] or self.regions[node] != region:
                continue
            if self.regions[partner] != region:
                continue
            for more in self._pairings(rest, offers[:index] + offers[index + 1 :], region):
                yield [(node, partner), *more]
