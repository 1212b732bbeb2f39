"""Dropout under a plan: each element's mask drawn from where the element is, not by the rank drawing it.

torch's dropout draws a mask from the generator of the process that runs it. Under a plan, a tensor that is
replicated over some ranks would then be dropped differently on each, and the copies the plan counts as one
would part: their gradients summed as one tensor's are no tensor's. Here the mask of an element is a hash of
the seed, of which draw this is (the pass's number and the dropout's place among the program's) and of the
element's index in the whole tensor, so every rank holding an element keeps or drops it alike, and the shards
put together are the mask one process draws with the same function (`MasksAsPlanned`, for a run to compare).

The hash is a 32-bit integer mix (Chris Wellons' "lowbias32" shape, with constants whose products with any
32-bit value stay within int64) on torch's int64 tensors: a dozen integer operations an element, the same on
every device and platform, where a counter-based generator would want a kernel of its own. The mask is
computed a piece of elements at a time, so that the hash's int64 temporaries stay small beside the tensor, and
the backward keeps it as booleans.

>>> x = torch.ones(4, 6)
>>> whole = dropped(x, 0.5, keep_mask(7, 3, 0.5, (4, 6), (slice(0, 4), slice(0, 6))))
>>> left = dropped(x[:, :3], 0.5, keep_mask(7, 3, 0.5, (4, 6), (slice(0, 4), slice(0, 3))))
>>> bool((whole[:, :3] == left).all()), sorted(set(whole.flatten().tolist())) == [0.0, 2.0]
(True, True)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_LOW = 0xFFFFFFFF
_FIRST, _SECOND = 0x7FEB352D, 0x5BD1E995  # odd, below 2**31: a product with a 32-bit value fits in int64
_UNIFORM_BITS = 24  # the mask compares this many bits of the hash with the probability
_PIECE = 1 << 22  # elements hashed at a time (`keep_mask`): a piece's int64 temporaries stay a few tens of MB


def _mixed(value: Any) -> Any:
    """A 32-bit value's hash (an int or an int64 tensor of values below 2**32), as 32 bits."""
    value = value ^ (value >> 16)
    value = (value * _FIRST) & _LOW
    value = value ^ (value >> 15)
    value = (value * _SECOND) & _LOW
    return value ^ (value >> 16)


def _key(seed: int, draw: int) -> int:
    """One 32-bit key per seed and draw (each taken in two halves)."""
    key = _mixed(seed & _LOW)
    for part in (seed >> 32, draw & _LOW, draw >> 32):
        key = _mixed(key ^ (part & _LOW))
    return key


def element_hashes(
    seed: int, draw: int, shape: Sequence[int], region: Sequence[slice], device: torch.device | None = None
) -> torch.Tensor:
    """The 32-bit hash of each element of ``region`` (one slice per dimension) of a tensor of ``shape`` for one
    draw, from the element's index in the whole tensor: the same whichever rank asks."""
    sizes = [part.stop - part.start for part in region]
    return _hashed(seed, draw, _indices(shape, region, 0, math.prod(sizes), device)).reshape(sizes)


def _indices(
    shape: Sequence[int], region: Sequence[slice], first: int, stop: int, device: torch.device | None
) -> torch.Tensor:
    """The whole tensor's (row-major) index of the region's elements ``first`` .. ``stop - 1``, in its order."""
    index = torch.arange(first, stop, dtype=torch.int64, device=device)
    place, stride = torch.zeros_like(index), 1
    for whole, part in reversed(list(zip(shape, region))):
        size = part.stop - part.start
        place += (index % size + part.start) * stride  # (the element's index along this dimension, whole)
        index, stride = index // size, stride * whole
    return place


def _hashed(seed: int, draw: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of each of the whole tensor's element indices ``index`` (int64) for one draw."""
    key = _key(seed, draw)
    return _mixed(_mixed((index & _LOW) ^ key) ^ (index >> 32) ^ _mixed(key ^ 0x9E3779B9))


def keep_mask(
    seed: int,
    draw: int,
    probability: float,
    shape: Sequence[int],
    region: Sequence[slice],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Which elements of ``region`` of a tensor of ``shape`` draw ``draw`` keeps: those whose hash
    (`element_hashes`), read as a fraction, is not below ``probability``. Hashed `_PIECE` elements of the region
    at a time, in its row-major order, whatever its shape."""
    threshold = int(probability * (1 << _UNIFORM_BITS))
    mask = torch.empty([part.stop - part.start for part in region], dtype=torch.bool, device=device)
    flat = mask.view(-1)
    for first in range(0, flat.numel(), _PIECE):
        stop = min(first + _PIECE, flat.numel())
        hashes = _hashed(seed, draw, _indices(shape, region, first, stop, device))
        flat[first:stop] = (hashes >> (32 - _UNIFORM_BITS)) >= threshold
    return mask


class _Dropped(torch.autograd.Function):
    """``x * mask * scale``, keeping the boolean mask for the backward (a byte an element, as the cost model
    counts it), not the mask cast to ``x``'s type."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask.to(x.dtype) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype) * ctx.scale, None, None


def dropped(x: torch.Tensor, probability: float, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with the elements ``mask`` does not keep zeroed and the others scaled by 1 / (1 - probability), as
    torch's dropout scales them."""
    if probability >= 1:
        return x * 0
    return _Dropped.apply(x, mask, 1.0 / (1.0 - probability))


def draws(nodes: Sequence[torch.fx.Node]) -> dict[str, int]:
    """The program's dropouts that draw a mask (a probability above 0, in training), each with its place among
    them in program order: the order one process calls them in."""
    found: dict[str, int] = {}
    for node in nodes:
        probability, training = dropout_arguments(node)
        if probability is not None and probability > 0 and training:
            found[node.name] = len(found)
    return found


DROPOUTS = frozenset({"aten.native_dropout.default", "aten.dropout.default"})


def drawn_apart(node: torch.fx.Node) -> str | None:
    """One sentence for a node that draws random numbers other than a dropout's mask, which each rank would draw
    from its own generator (the replicas of a value parting, the shards no one tensor's), else None. An attention
    kernel's own dropout is one: the ONNX exporter leaves it out of the file, so the plan does not drop there."""
    target = node.target
    seeded = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
    if node.op != "call_function" or not seeded or str(target) in DROPOUTS:
        return None
    names = [argument.name for argument in target._schema.arguments]  # type: ignore[union-attr]
    if "dropout_p" not in names:
        return (
            f"Module node {node.name!r} ({target}) draws random numbers, which each rank would draw apart from the"
            " others; autopar draws dropout's masks alone (autopar.torch.dropout)."
        )
    at = names.index("dropout_p")
    probability = node.args[at] if len(node.args) > at else node.kwargs.get("dropout_p", 0.0)
    if not probability:
        return None
    return (
        f"Module node {node.name!r} ({target}) drops attention probabilities (dropout_p={probability}), which the"
        " plan's model does not: the ONNX exporter leaves that dropout out of the file. Set the attention dropout"
        " to 0, or run eager attention (attn_implementation='eager'), whose dropout autopar draws alike on every"
        " rank."
    )


def dropout_arguments(node: torch.fx.Node) -> tuple[float | None, bool]:
    """A dropout node's probability and whether it trains ((None, False) for any other node)."""
    if node.op != "call_function" or str(node.target) not in DROPOUTS:
        return None, False
    args: Any = node.args
    probability: Any = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
    training: Any = args[2] if len(args) > 2 else node.kwargs.get("train", True)
    return float(probability), bool(training)


class MasksAsPlanned:
    """In one process, torch's ``dropout`` drawing the masks a plan's ranks draw (`keep_mask`), to compare a
    sharded run with one process: ``with MasksAsPlanned(seed).drawing(): ...`` counts the draws (every call that
    drops, in order) as the ranks number theirs, pass after pass (a micro-batch is a pass of its own). The ranks
    number the dropouts of the captured program, so the two agree where each call in training is one of its
    nodes: not for a dropout whose result nothing reads (the capture drops it), nor one called with
    ``training=True`` in ``eval()`` mode. ``inplace`` is not honoured. It patches ``torch.nn.functional`` for
    the process while it is open: a helper for a reference run, not for threads."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    @contextlib.contextmanager
    def drawing(self) -> Iterator["MasksAsPlanned"]:
        functional = torch.nn.functional
        original = functional.dropout

        def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
            if not training or p == 0:
                return x
            mask = keep_mask(self.seed, self.calls, p, tuple(x.shape), [slice(0, size) for size in x.shape], x.device)
            self.calls += 1
            return dropped(x, p, mask)

        functional.dropout = dropout  # type: ignore[assignment]
        try:
            yield self
        finally:
            functional.dropout = original
