"""The analytic step-time model: a step is bound either by arithmetic or by HBM traffic, from a
:class:`HardwareSpec` and a :class:`ModelSpec` (the bundled ones are in
:mod:`meridian.sim.presets`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TypedDict

from meridian.errors import ConfigError
from meridian.sim.steptime.base import NS_PER_S, BatchShape

__all__ = ["Bound", "HardwareSpec", "ModelSpec", "RooflineStepTime", "StepBreakdown"]


def _check_fraction(where: str, value: float) -> None:
    if not (0.0 < value <= 1.0):
        raise ConfigError(f"{where} must be in (0, 1]; got {value}")


def _check_positive(where: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{where} must be a positive finite number; got {value}")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator, as the roofline sees it.

    ``peak_flops`` is dense (no 2:4 sparsity) bf16 tensor-core FLOP/s and ``hbm_bandwidth`` is
    bytes/s, both datasheet peaks. ``mfu`` and ``bandwidth_efficiency`` are the fractions of those
    peaks a serving engine reaches; ``step_overhead_ns`` is the fixed host-side cost of a step
    (scheduling, input preparation, kernel launches) and ``per_request_overhead_ns`` the part that
    grows with the number of requests (per-row bookkeeping, sampling, output processing).
    ``host_link_bandwidth`` is the host link's datasheet bytes/s in one direction (KV offload
    copies over it, at ``bandwidth_efficiency`` of it); 0 where unknown.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: int
    mfu: float
    bandwidth_efficiency: float
    step_overhead_ns: int
    per_request_overhead_ns: int
    host_link_bandwidth: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        where = f"hardware.{self.name}"
        _check_positive(f"{where}.peak_flops", self.peak_flops)
        _check_positive(f"{where}.hbm_bandwidth", self.hbm_bandwidth)
        _check_positive(f"{where}.memory_bytes", self.memory_bytes)
        _check_fraction(f"{where}.mfu", self.mfu)
        _check_fraction(f"{where}.bandwidth_efficiency", self.bandwidth_efficiency)
        if self.step_overhead_ns < 0 or self.per_request_overhead_ns < 0:
            raise ConfigError(
                f"{where}: step_overhead_ns and per_request_overhead_ns must be >= 0; got "
                f"{self.step_overhead_ns}, {self.per_request_overhead_ns}"
            )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a dense decoder-only transformer, as far as step cost is concerned.

    The KV cache is assumed to be stored in the weights' dtype (``bytes_per_param``), which is
    vLLM's default (``--kv-cache-dtype auto``).
    """

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        where = f"model.{self.name}"
        for field in (
            "num_params",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "bytes_per_param",
        ):
            value = getattr(self, field)
            if value < 1:
                raise ConfigError(f"{where}.{field} must be >= 1; got {value}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by every step (all of them: a dense model)."""
        return self.num_params * self.bytes_per_param


class Bound(enum.StrEnum):
    """Which roof a step hits. A ``StrEnum``, so it compares equal to ``"compute"``/``"memory"``."""

    COMPUTE = "compute"
    MEMORY = "memory"


class StepBreakdown(TypedDict):
    """Where a roofline step's time goes (seconds); ``bound`` names the larger roof."""

    compute_s: float
    memory_s: float
    overhead_s: float
    bound: Bound


class RooflineStepTime:
    """Analytic step time: the larger of the compute and memory roofs, plus host overhead.

    ::

        time = max(FLOPs / (peak_flops * mfu), bytes / (hbm_bandwidth * bandwidth_efficiency))
               + step_overhead_ns + per_request_overhead_ns * num_seqs

        FLOPs = 2 * num_params * num_query_tokens               (every token through every matmul)
              + 4 * num_layers * num_attention_heads * head_dim * attended_pairs
        bytes = weight_bytes + num_kv_tokens_read * kv_bytes_per_token

    ``4 * L * H * d`` per (query, key) pair is ``QK^T`` (2d FLOPs per head) plus ``PV`` (2d).
    What ``attended_pairs`` counts, given only the step totals::

        attended_pairs = num_kv_tokens_read + num_prefill_tokens * (num_prefill_tokens - 1) / 2

    - each request's last row attends its whole context: ``num_kv_tokens_read`` in total, exact
      for decode rows (a decode row *is* its request's last row);
    - the other rows of a prefill chunk attend causally within the chunk. This is exact for one
      fresh prompt (``c (c + 1) / 2`` pairs); it leaves out what the earlier rows of a later
      chunk (or a recompute) attend in the request's prefix (``(c - 1) * prefix`` pairs), and it
      counts the prefill tokens of several requests as one chunk (cross-request pairs that do
      not exist). Either error is confined to the attention term, which for every preset is at
      most about a third of the ``2 * num_params`` per token of the matmuls at contexts up to
      10k tokens (e.g. 4 * 32 * 32 * 128 * 10k = 5.2 GFLOP vs 16.1 GFLOP for Llama-3-8B).

    ``num_seqs`` enters only through the per-request overhead, so step time is non-decreasing in
    every field. Simplifications: the embedding table counts as a matmul and so do the logits
    vLLM skips for non-final prefill rows (``2 * num_params`` per token slightly overstates);
    activations and KV writes are left out of the byte count. An empty batch costs 0.
    """

    __slots__ = (
        "_attn_flops_per_pair",
        "_flops_per_token",
        "_kv_bytes_per_token",
        "_per_request_ns",
        "_step_overhead_ns",
        "_sustained_bandwidth",
        "_sustained_flops",
        "_weight_bytes",
        "hardware",
        "label",
        "model",
    )

    def __init__(self, hardware: HardwareSpec, model: ModelSpec) -> None:
        self.hardware = hardware
        self.model = model
        self.label = f"roofline:{hardware.name}/{model.name}"
        self._flops_per_token = 2.0 * model.num_params
        self._attn_flops_per_pair = 4.0 * model.num_layers * model.num_attention_heads
        self._attn_flops_per_pair *= model.head_dim
        self._weight_bytes = float(model.weight_bytes)
        self._kv_bytes_per_token = float(model.kv_bytes_per_token)
        self._sustained_flops = hardware.peak_flops * hardware.mfu
        self._sustained_bandwidth = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
        self._step_overhead_ns = hardware.step_overhead_ns
        self._per_request_ns = hardware.per_request_overhead_ns

    def flops(self, batch: BatchShape) -> float:
        """Floating-point operations of the step (see the class docstring for what counts)."""
        p = batch.num_prefill_tokens
        attended_pairs = batch.num_kv_tokens_read + p * (p - 1) / 2
        return (
            self._flops_per_token * batch.num_query_tokens
            + self._attn_flops_per_pair * attended_pairs
        )

    def bytes_read(self, batch: BatchShape) -> float:
        """HBM bytes the step reads: all weights once, plus every attended KV entry once."""
        return self._weight_bytes + self._kv_bytes_per_token * batch.num_kv_tokens_read

    def breakdown(self, batch: BatchShape) -> StepBreakdown:
        """Seconds per roof and of overhead; all zero for an empty batch."""
        if batch.is_empty:
            return StepBreakdown(compute_s=0.0, memory_s=0.0, overhead_s=0.0, bound=Bound.MEMORY)
        compute_s = self.flops(batch) / self._sustained_flops
        memory_s = self.bytes_read(batch) / self._sustained_bandwidth
        overhead_ns = self._step_overhead_ns + self._per_request_ns * batch.num_seqs
        return StepBreakdown(
            compute_s=compute_s,
            memory_s=memory_s,
            overhead_s=overhead_ns / NS_PER_S,
            bound=Bound.COMPUTE if compute_s > memory_s else Bound.MEMORY,
        )

    def step_time_ns(self, batch: BatchShape) -> int:
        """``max(compute, memory)`` rounded to the nanosecond, plus overheads; 0 when empty."""
        if batch.is_empty:
            return 0
        compute_s = self.flops(batch) / self._sustained_flops
        memory_s = self.bytes_read(batch) / self._sustained_bandwidth
        return (
            round(max(compute_s, memory_s) * NS_PER_S)
            + self._step_overhead_ns
            + self._per_request_ns * batch.num_seqs
        )

    def __repr__(self) -> str:
        return f"RooflineStepTime({self.hardware.name!r}, {self.model.name!r})"
