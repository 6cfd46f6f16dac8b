# mypy: disable-error-code="import-not-found,no-any-unimported,misc"
"""The worker side of vLLM's ``OffloadingConnector``, modelled on virtual time.

``meridian bench sim --engine vllm --kv-offload-gib N`` gives vLLM's scheduler its real
``OffloadingConnector`` (scheduler side: which blocks are stored, the host tier and its eviction
policy, lookups on re-admission, flushes on preemption; :func:`meridian.vllm.serve.
kv_offload_transfer_config`, as ``meridian serve --kv-offload-gib`` writes it). Only the worker
is missing, as the model is: :class:`HostLink` stands in for it and reports each transfer job
finished when a copy of its blocks over the host link would have finished.

What is modelled, after vLLM's offloading worker (``offloading/worker.py``):

- each direction of the link is one FIFO copy engine at ``bytes_per_s``;
- a store job scheduled with step ``k`` copies blocks step ``k`` computes, so it starts when
  step ``k`` ends (vLLM submits stores one step late for that reason);
- a load job starts when its step starts; its request waits, unscheduled, until the load is
  reported finished (``finished_recving``);
- a step that must flush stores (``jobs_to_flush``: a preempted request's blocks are about to be
  reused) starts only when those stores have finished;
- completions are reported with the first step that ends after them, as the worker reports
  them with its next model output.

Transfers cost the step nothing else: the copy engines overlap with compute. No data moves, so
nothing can be wrong with it; failed transfers are not modelled.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HostLink", "LinkCounters"]


@dataclass(slots=True)
class LinkCounters:
    """What crossed the link (blocks, both directions) and the time steps waited on flushes."""

    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    flush_wait_ns: int = 0


@dataclass(slots=True)
class HostLink:
    """Both copy engines of the host link (module docstring)."""

    block_bytes: int
    bytes_per_s: float
    counters: LinkCounters = field(default_factory=LinkCounters)
    _free_ns: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    _end_ns: dict[int, int] = field(default_factory=dict)  # job id -> its copy's end
    # (end, job id, request id of a load or "") of jobs not yet reported finished
    _pending: list[tuple[int, int, str]] = field(default_factory=list)
    # (job id, blocks) of the running step's stores: they copy what it computes
    _deferred_stores: list[tuple[int, int]] = field(default_factory=list)

    def start_step(self, meta: Any, start_ns: int) -> int:
        """The step of ``meta`` (its ``OffloadingConnectorMetadata``, or ``None``) is ready to
        start at ``start_ns``: submit its loads; returns when it really starts (after the stores
        it must flush). Its stores wait for :meth:`end_step`."""
        if meta is None:
            return start_ns
        flushed = [self._end_ns[j] for j in meta.jobs_to_flush or () if j in self._end_ns]
        ready = max([start_ns, *flushed])
        self.counters.flush_wait_ns += ready - start_ns
        for job_id, job in meta.load_jobs.items():
            self._copy(job_id, len(job.dst_spec.block_ids), job.req_id, ready, load=True)
        self._deferred_stores = [
            (job_id, len(job.src_spec.block_ids)) for job_id, job in meta.store_jobs.items()
        ]
        return ready

    def end_step(self, end_ns: int) -> list[tuple[int, str]]:
        """The step ended at ``end_ns``: its stores start copying; returns every job finished by
        then, ``(job id, request id)`` (the request id empty for a store), for the driver to
        report to vLLM as the worker would (:func:`meridian.sim.vllm_engine` builds vLLM's
        ``KVConnectorOutput`` from them)."""
        for job_id, num_blocks in self._deferred_stores:
            self._copy(job_id, num_blocks, "", end_ns, load=False)
        self._deferred_stores.clear()
        return self._finished_by(end_ns)

    def next_finish_ns(self) -> int | None:
        """When the next pending copy ends (``None``: the link is idle)."""
        return self._pending[0][0] if self._pending else None

    def _copy(self, job_id: int, num_blocks: int, req_id: str, at_ns: int, *, load: bool) -> None:
        start = max(at_ns, self._free_ns[load])
        end = start + max(1, round(num_blocks * self.block_bytes / self.bytes_per_s * 1e9))
        self._free_ns[load] = end
        self._end_ns[job_id] = end
        heapq.heappush(self._pending, (end, job_id, req_id))
        if load:
            self.counters.num_loaded_blocks += num_blocks
        else:
            self.counters.num_stored_blocks += num_blocks

    def _finished_by(self, time_ns: int) -> list[tuple[int, str]]:
        done: list[tuple[int, str]] = []
        while self._pending and self._pending[0][0] <= time_ns:
            _, job_id, req_id = heapq.heappop(self._pending)
            self._end_ns.pop(job_id, None)
            done.append((job_id, req_id))
        return done
