"""The cost model: compute (roofline), memory, and collectives (alpha-beta over the mesh levels).

Hardware numbers live in `costmodels/*.toml`, each with its source; this module only turns
them into seconds and bytes. What is not hardware is here: the bytes each optimizer keeps per
parameter (`OPTIMIZER_STATE_BYTES`). Collectives over bits that span several levels run
hierarchically (fastest level first), as HCCL and Horovod do: a ReduceScatter over a level of
g ranks costs (g-1) x (alpha + payload / (g x bandwidth)) and shrinks the payload g-fold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import numpy as np

from autopar.cost.profile import HardwareProfile, OptimizerName
from autopar.errors import CostModelError, MemoryReserveError, PrecisionError
from autopar.redistribute import Collective
from autopar.units import human_bytes

Precision = Literal["mixed", "fp32", "fp8"]
PRECISIONS = ("mixed", "fp32", "fp8")

Optimizer = OptimizerName
OPTIMIZERS: tuple[Optimizer, ...] = ("adam", "sgd")

OPTIMIZER_STATE_BYTES: dict[str, float] = {"adam": 8.0, "sgd": 4.0}
"""FP32 optimizer state per parameter: Adam's two moments (first and second, 4 B each) and SGD's one
momentum buffer. With the FP32 master weights (4 B) mixed precision adds and the FP16 weights and
gradient (2 B each), Adam keeps 2 + 2 + 4 + 8 = 16 B a parameter: the "16 Psi" of the ZeRO paper
(Rajbhandari et al., SC20, section 3.1), which Megatron-LM keeps too; momentum SGD keeps 12 B."""

MASTER_WEIGHT_BYTES = 4.0
"""The FP32 copy of the weights the optimizer updates under mixed precision (ZeRO, section 3.1); in FP32
training the weights themselves are that copy."""

WORKING_COPY_BYTES = 2.0
"""The FP16 (or BF16) weights the forward reads under mixed precision, written from the master copy by each
update."""


class CostModel:
    """Seconds and bytes for one profile at one precision.

    ``precision``: ``mixed`` (FP16/BF16 compute, FP32 master weights), ``fp32``, or ``fp8``: mixed precision
    with the products of a weight (MatMul, Gemm; Transformer Engine's Linear layers) in FP8 at the profile's
    ``peak_flops_fp8`` and the activations they alone keep for the backward in FP8, as Transformer Engine
    runs them; products of two activations, convolutions, attention kernels and the rest stay in BF16.

    ``overlap``: bucketed gradient synchronisation runs beside the backward pass (Horovod, DDP,
    MindSpore), so only what the remaining backward compute cannot cover is exposed; without it
    every gradient AllReduce adds to the step.

    ``optimizer`` (``adam`` or ``sgd``; the profile's default when None) sets the optimizer state per
    parameter; ``memory_reserve`` (bytes; the profile's when None) is device memory plans leave free
    for workspace, communication buffers and allocator fragmentation: ``capacity`` is what is left.
    """

    def __init__(
        self,
        profile: HardwareProfile,
        precision: Precision = "mixed",
        overlap: bool = True,
        optimizer: Optimizer | None = None,
        memory_reserve: float | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise CostModelError(f"Unknown precision {precision!r}; choose mixed, fp32 or fp8.")
        if precision == "fp8" and profile.compute.peak_flops_fp8 is None:
            raise PrecisionError(
                f"The {profile.name} profile has no FP8 matrix units (no peak_flops_fp8); choose --precision mixed"
                " or fp32, or a profile that has them (h100, h200)."
            )
        optimizer = profile.training.optimizer.value if optimizer is None else optimizer
        if optimizer not in OPTIMIZERS:
            raise CostModelError(f"Unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}.")
        self.profile = profile
        self.precision = precision
        self.overlap = overlap
        self.optimizer: Optimizer = optimizer
        compute = profile.compute
        self.device_capacity = compute.hbm_capacity.value
        reserve = compute.memory_reserve.value if memory_reserve is None else memory_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < math.inf:
            raise MemoryReserveError(f"The memory reserve must be a number of bytes from 0 up, got {reserve!r}.")
        if reserve >= self.device_capacity:
            raise MemoryReserveError(
                f"The memory reserve of {human_bytes(reserve)} leaves nothing of the device's"
                f" {human_bytes(self.device_capacity)} ({profile.name}); give a smaller reserve."
            )
        self.memory_reserve = float(reserve)
        self.peak_flops = (compute.peak_flops_fp32 if precision == "fp32" else compute.peak_flops_fp16).value
        self.cube_flops = self.peak_flops * compute.cube_efficiency.value
        self.matmul_flops = self.peak_flops * compute.matmul_efficiency.value  # a large matmul's rate
        fp8 = compute.peak_flops_fp8 if precision == "fp8" else None  # a weight's products in FP8, the rest BF16
        self.fp8_matmul_flops = None if fp8 is None else fp8.value * compute.matmul_efficiency.value
        falloff = compute.matmul_falloff
        self._falloff_log2 = np.log2(np.asarray(falloff.smallest_dim, dtype=np.float64))
        self._falloff = np.asarray(falloff.factor, dtype=np.float64)
        attention = compute.attention_efficiency
        self.attention_flops = None if attention is None else self.peak_flops * attention.value
        self.vector_flops = compute.peak_flops_fp16.value * compute.vector_flops_fraction.value
        if precision == "fp32":
            self.vector_flops /= 2
        self.memory_bandwidth = compute.hbm_bandwidth.value * compute.memory_efficiency.value
        self.capacity = self.device_capacity - self.memory_reserve  # what a plan may fill
        training = profile.training
        self.backward_factor = training.backward_compute_factor.value
        self.fusion_bytes = training.gradient_fusion_bytes.value
        self._coefficients: dict[tuple[str, tuple[int, ...]], tuple[float, float]] = {}

    # --- sizes -----------------------------------------------------------------------------

    def activation_itemsize(self, dtype: str) -> int:
        """Bytes of one element as the device computes it: floats are FP16 in mixed precision."""
        if dtype in ("float32", "float64", "float16"):
            return 4 if self.precision == "fp32" else 2
        if dtype in ("int64", "uint64", "float64"):
            return 8
        if dtype in ("bool", "int8", "uint8"):
            return 1
        if dtype in ("int16", "uint16", "bfloat16"):
            return 2
        return 4

    def gradient_itemsize(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def kept_product_itemsize(self) -> int | None:
        """Bytes of an activation kept only for the backward of a weight's products, where they keep it in FP8
        (1 B, as Transformer Engine saves its FP8 cast of a Linear's input); None where they keep the compute
        dtype."""
        return 1 if self.precision == "fp8" else None

    def parameter_bytes_per_element(self, trainable: bool, state_shards: int = 1) -> float:
        """Device memory per parameter element: weights, gradient and optimizer state.

        With a parallel optimizer (ZeRO-2) the gradient, the optimizer state and, in mixed
        precision, the FP32 master weights are split ``state_shards`` ways; the weights the
        forward pass reads stay whole.
        """
        working, state = self.parameter_bytes_split(trainable)
        return working + state / state_shards

    def parameter_bytes_split(self, trainable: bool) -> tuple[float, float]:
        """(bytes per element the forward reads, bytes per element a parallel optimizer may shard)."""
        if not trainable:
            return 4.0, 0.0
        state = self.gradient_itemsize() + OPTIMIZER_STATE_BYTES[self.optimizer]
        if self.precision != "fp32":
            return 2.0, MASTER_WEIGHT_BYTES + state  # the FP16 working copy; the FP32 master is optimizer state
        return MASTER_WEIGHT_BYTES, state  # FP32 weights are the master copy

    def update_bytes_per_element(self) -> float:
        """Bytes the optimizer update moves per parameter element it updates: it reads the FP32 weights (the
        master copy in mixed precision), the gradient and the optimizer state and writes the weights and the
        state back, and in mixed precision the FP16 working copy too, each once (a fused update, as PyTorch's
        fused AdamW and Apex's multi-tensor kernels run it). Adam: 4 + 2 + 8 read and 4 + 8 + 2 written, 28 B
        in mixed precision, 28 in FP32 (its gradient FP32, no working copy); momentum SGD 20. Counted, not
        fitted: on an H200 the fused AdamW of 1.92 B FP32 parameters took 16.7 ms (torch.profiler, a 4-layer
        Llama-3-8B-shaped decoder), where 28 B each at 4.8 TB/s and the h100 profile's assumed memory
        efficiency of 0.8 give 14.0 ms."""
        working = 0.0 if self.precision == "fp32" else WORKING_COPY_BYTES
        state = MASTER_WEIGHT_BYTES + OPTIMIZER_STATE_BYTES[self.optimizer]
        return 2 * state + self.gradient_itemsize() + working

    def update_time(self, elements: np.ndarray | float) -> np.ndarray | float:
        """Seconds the optimizer update of so many parameter elements on one device takes: its bytes
        (`update_bytes_per_element`) at the memory bandwidth the profile reaches; paid once a step, after the
        gradients are synchronised."""
        return elements * self.update_bytes_per_element() / self.memory_bandwidth

    # --- compute ---------------------------------------------------------------------------

    @property
    def attention_rate(self) -> float:
        """FLOP/s of the fused attention kernel (``attention_efficiency`` of the peak), asked only of a profile
        that has one (`autopar.search.dataflow.fused_parts` finds no attention to fuse elsewhere)."""
        if self.attention_flops is None:
            raise CostModelError(f"The {self.profile.name} profile has no fused attention kernel.")
        return self.attention_flops

    def matmul_rate(self, smallest_dim: np.ndarray | float, fp8: bool = False) -> np.ndarray:
        """FLOP/s of a matmul whose smallest per-device dimension (of M, N and K) is ``smallest_dim``:
        the large-matmul rate times the profile's fall-off factor at that size (interpolated on log2 of
        the size, the table's end values outside it). ``fp8``: a weight's product under ``--precision fp8``,
        at the FP8 peak (`fp8_matmul_flops`)."""
        size = np.maximum(np.asarray(smallest_dim, dtype=np.float64), 1.0)
        return self._large(fp8) * np.interp(np.log2(size), self._falloff_log2, self._falloff)

    def _large(self, fp8: bool) -> float:
        return self.fp8_matmul_flops if fp8 and self.fp8_matmul_flops is not None else self.matmul_flops

    @property
    def fastest_matmul_rate(self) -> float:
        """The most FLOP/s any matmul reaches (the large-matmul rate at the fall-off table's best factor)."""
        return self.matmul_flops * float(np.max(self._falloff))

    def fastest_matmul_rate_up_to(self, smallest_dim: float, fp8: bool = False) -> float:
        """The most FLOP/s a matmul whose smallest per-device dimension is at most ``smallest_dim`` reaches:
        `matmul_rate` is piecewise linear in log2 of the size, so its largest value up to there is at one
        of the table's sizes or at an end.

        >>> from autopar.cost import load_profile
        >>> cost = CostModel(load_profile("a100"))
        >>> cost.fastest_matmul_rate_up_to(1e9) == cost.fastest_matmul_rate
        True
        >>> cost.fastest_matmul_rate_up_to(64) <= cost.fastest_matmul_rate
        True
        """
        top = float(np.log2(max(float(smallest_dim), 1.0)))
        sizes = [0.0, *(x for x in self._falloff_log2.tolist() if 0.0 < x < top), top]
        return self._large(fp8) * float(np.max(np.interp(sizes, self._falloff_log2, self._falloff)))

    def compute_time(self, op_class: str, flops: float, nbytes: float, matmul_dim: float | None = None) -> float:
        """Roofline: the slower of arithmetic and memory traffic.

        ``matmul_dim``: the operator is a matmul (MatMul, Gemm) whose smallest per-device dimension is
        this, so it runs at `matmul_rate`; other "cube" work (convolutions) runs at the cube efficiency.
        """
        if op_class == "free":
            return 0.0
        if matmul_dim is not None:
            rate = float(self.matmul_rate(matmul_dim))
        else:
            rate = self.cube_flops if op_class == "cube" else self.vector_flops
        return max(flops / rate, nbytes / self.memory_bandwidth)

    # --- communication -----------------------------------------------------------------------

    def _levels(self, bits: Iterable[int]) -> list[tuple[int, float, float]]:
        """(group size, latency, bandwidth) per mesh level the bits touch, fastest level first."""
        counts: dict[str, int] = {}
        order: list = []
        for bit in sorted(bits):
            level = self.profile.level_of_bit(bit)
            if level.name not in counts:
                order.append(level)
                counts[level.name] = 0
            counts[level.name] += 1
        return [(1 << counts[lv.name], lv.latency.value, lv.bandwidth.value) for lv in order]

    def collective_coefficients(self, kind: Collective, bits: tuple[int, ...]) -> tuple[float, float]:
        """(latency seconds, seconds per payload byte): every collective here is affine in its payload."""
        key = (kind, bits)
        hit = self._coefficients.get(key)
        if hit is not None:
            return hit
        latency = per_byte = 0.0
        if bits and kind != Collective.SLICE:
            if kind not in (
                Collective.REDUCE_SCATTER,
                Collective.ALL_GATHER,
                Collective.ALL_REDUCE,
                Collective.ALL_TO_ALL,
            ):
                raise ValueError(f"unknown collective {kind!r}")
            shrink = 1.0
            for group, alpha, bandwidth in self._levels(bits):
                latency += (group - 1) * alpha
                per_byte += (group - 1) / group / bandwidth / shrink
                if kind != Collective.ALL_TO_ALL:
                    shrink *= group  # a ReduceScatter hands 1/g of the payload to the next level
            if kind == Collective.ALL_REDUCE:  # ReduceScatter then AllGather
                latency, per_byte = 2 * latency, 2 * per_byte
        self._coefficients[key] = (latency, per_byte)
        return latency, per_byte

    def collective_time(
        self, kind: Collective, bits: Iterable[int], nbytes: float, latency_scale: float = 1.0
    ) -> float:
        """Seconds for one collective whose per-rank payload is ``nbytes`` (see `Step`)."""
        latency, per_byte = self.collective_coefficients(kind, tuple(bits))
        return latency * latency_scale + per_byte * nbytes

    def send_time(self, bit: int, nbytes: float | np.ndarray) -> float | np.ndarray:
        """One point-to-point transfer of ``nbytes`` between two devices that differ in mesh bit ``bit``
        (and lower ones): the latency and bandwidth of that bit's link, as one step of a ring pays them.

        >>> from autopar.cost import load_profile
        >>> cost = CostModel(load_profile("ascend910"))
        >>> cost.send_time(2, 0.0) == cost.profile.level_of_bit(2).latency.value
        True
        """
        level = self.profile.level_of_bit(bit)
        return level.latency.value + nbytes / level.bandwidth.value

    def gradient_sync_time(self, bits: Iterable[int], nbytes: float, kind: Collective = Collective.ALL_REDUCE) -> float:
        """A parameter's gradient AllReduce (or a parallel optimizer's ReduceScatter, or its AllGather
        of the updated weights); fused buckets pay the latency once per bucket."""
        scale = min(1.0, nbytes / self.fusion_bytes)
        return self.collective_time(kind, bits, nbytes, latency_scale=scale)
