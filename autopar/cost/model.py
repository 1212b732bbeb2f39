"""The cost model: compute (roofline), memory, and collectives (alpha-beta over the mesh levels).

Hardware numbers live in `costmodels/*.toml`, each with its source; this module only turns
them into seconds and bytes. Collectives over bits that span several levels run
hierarchically (fastest level first), as HCCL and Horovod do: a ReduceScatter over a level of
g ranks costs (g-1) x (alpha + payload / (g x bandwidth)) and shrinks the payload g-fold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from autopar.cost.profile import HardwareProfile
from autopar.errors import CostModelError
from autopar.redistribute import Collective

Precision = Literal["mixed", "fp32"]
PRECISIONS = ("mixed", "fp32")


class CostModel:
    """Seconds and bytes for one profile at one precision.

    ``overlap``: bucketed gradient synchronisation runs beside the backward pass (Horovod, DDP,
    MindSpore), so only what the remaining backward compute cannot cover is exposed; without it
    every gradient AllReduce adds to the step.
    """

    def __init__(self, profile: HardwareProfile, precision: Precision = "mixed", overlap: bool = True) -> None:
        if precision not in PRECISIONS:
            raise CostModelError(f"Unknown precision {precision!r}; choose mixed or fp32.")
        self.profile = profile
        self.precision = precision
        self.overlap = overlap
        compute = profile.compute
        self.peak_flops = (compute.peak_flops_fp16 if precision == "mixed" else compute.peak_flops_fp32).value
        self.cube_flops = self.peak_flops * compute.cube_efficiency.value
        self.vector_flops = compute.peak_flops_fp16.value * compute.vector_flops_fraction.value
        if precision == "fp32":
            self.vector_flops /= 2
        self.memory_bandwidth = compute.hbm_bandwidth.value * compute.memory_efficiency.value
        self.capacity = compute.hbm_capacity.value
        training = profile.training
        self.backward_factor = training.backward_compute_factor.value
        self.fusion_bytes = training.gradient_fusion_bytes.value
        self._coefficients: dict[tuple[str, tuple[int, ...]], tuple[float, float]] = {}

    # --- sizes -----------------------------------------------------------------------------

    def activation_itemsize(self, dtype: str) -> int:
        """Bytes of one element as the device computes it: floats are FP16 in mixed precision."""
        if dtype in ("float32", "float64", "float16"):
            return 2 if self.precision == "mixed" else 4
        if dtype in ("int64", "uint64", "float64"):
            return 8
        if dtype in ("bool", "int8", "uint8"):
            return 1
        if dtype in ("int16", "uint16", "bfloat16"):
            return 2
        return 4

    def gradient_itemsize(self) -> int:
        return 2 if self.precision == "mixed" else 4

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
        training = self.profile.training
        if not trainable:
            return 4.0, 0.0
        master = training.master_weight_bytes_per_param.value
        state = self.gradient_itemsize() + training.optimizer_state_bytes_per_param.value
        if self.precision == "mixed":
            return 2.0, master + state  # the FP16 working copy; the FP32 master is optimizer state
        return master, state

    # --- compute ---------------------------------------------------------------------------

    def compute_time(self, op_class: str, flops: float, nbytes: float) -> float:
        """Roofline: the slower of arithmetic and memory traffic."""
        if op_class == "free":
            return 0.0
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

    def gradient_sync_time(self, bits: Iterable[int], nbytes: float, kind: Collective = Collective.ALL_REDUCE) -> float:
        """A parameter's gradient AllReduce (or a parallel optimizer's ReduceScatter, or its AllGather
        of the updated weights); fused buckets pay the latency once per bucket."""
        scale = min(1.0, nbytes / self.fusion_bytes)
        return self.collective_time(kind, bits, nbytes, latency_scale=scale)
