# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""Meridian's logits processors: per-row entropy on device and ``</think>`` forcing.

Pass with ``--logits-processors meridian.vllm.logits:MeridianLogitsProcessor`` (V1 model
runner: vLLM's CPU default) or ``meridian.vllm.logits:MeridianLogitsProcessorV2`` (V2 model
runner: the GPU default). Both see the whole ``[rows, vocab]`` logits tensor once per step,
before temperature and top-k/top-p, and do per row:

1. feed the row's new output tokens to its own phase router (:class:`~meridian.core.forcing.
   ThinkForcer`);
2. while the request thinks: the Shannon entropy of the row, in torch on the logits' device
   (:func:`entropy_torch`, agreeing with :func:`meridian.core.entropy.entropy_nats` within
   1e-5), into the request's EAT/RPDI probe;
3. the core :class:`~meridian.core.budget.BudgetPolicy`: when it fires, the row is masked to
   ``-inf`` everywhere but the ``think_end`` token, so whatever the sampling settings the
   request emits ``</think>`` (a multi-token marker over the next steps).

Per-request knobs in ``SamplingParams.extra_args`` (:func:`~meridian.vllm.runtime.
parse_request_budget`): ``meridian_max_think_tokens`` (positive int, replaces the hard cap) and
``meridian_forcing`` (``"on"``/``"off"``). Invalid values are rejected at admission by
``validate_params`` (HTTP 400 for that request; offline, an exception from ``generate``); the
other requests are unaffected. A request whose own ``allowed_token_ids`` or ``bad_words`` forbid
a token a force emits is never forced: the client's restriction wins
(:meth:`~meridian.vllm.runtime.MeridianRuntime.request_budget`).

Fail open: an exception in Meridian's per-step code is logged once, counted in
``num_errors``, and the logits are returned untouched for that step.

``is_argmax_invariant()`` is False: forcing changes the greedy choice, so vLLM applies the
processor under greedy sampling too.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from meridian.core.budget import BudgetPolicy, RequestBudget
from meridian.core.forcing import ForceRecord, ThinkForcer
from meridian.core.types import ForceReason
from meridian.telemetry.metrics import MeridianMetrics
from meridian.vllm.runtime import MeridianRuntime, parse_request_budget, runtime_from_vllm_config

__all__ = ["MeridianLogitsProcessor", "MeridianLogitsProcessorV2", "entropy_torch"]

logger = logging.getLogger(__name__)

# Removed rows the V1 processor keeps for their return, per running request vLLM allows
# (``max_num_seqs``; DEFAULT_MAX_SEQS where the config does not say). A deferred request is
# back within a few steps; at most max_num_seqs requests leave the batch in one step.
PARKED_PER_SEQ = 2
DEFAULT_MAX_SEQS = 256
# sys.getrefcount of a kept row's output list that only the forcer refers to.
_OWN_REFERENCES = 2


def entropy_torch(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of ``softmax(logits)`` per row, computed in float32.

    ``logits`` is ``[rows, vocab]`` (or ``[vocab]``) of any float dtype on any device;
    ``-inf`` entries are masked tokens (probability 0). Returns ``[rows]`` float32 on the same
    device. A row without a finite logit gives NaN (callers skip it).

    The core's stable form, ``H = log S - T / S`` with ``z = x - max(x)``, ``S = sum(exp z)``,
    ``T = sum(exp(z) * z)``: it agrees with :func:`meridian.core.entropy.entropy_nats` within
    1e-5 nats at a 152k vocabulary, where ``-sum(p * log_softmax(x))`` in float32 drifts by
    3e-5.
    """
    x = logits.float()
    z = x - x.amax(dim=-1, keepdim=True)
    e = z.exp()
    # exp(-inf) = 0 and 0 * -inf is NaN: a masked token contributes nothing to T.
    z = torch.where(e > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    s = e.sum(dim=-1)
    return s.log() - (e * z).sum(dim=-1) / s


def _force_rows(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """Mask ``rows`` of ``logits`` in place to ``-inf`` except one token each (set to 0)."""
    device = logits.device
    row_t = torch.tensor(rows, dtype=torch.long, device=device)
    tok_t = torch.tensor(token_ids, dtype=torch.long, device=device)
    logits[row_t] = float("-inf")
    logits[row_t, tok_t] = 0.0


class _ProcessorCore:
    """What both interfaces share: runtime, policy, forcer, error accounting."""

    def __init__(self, runtime: MeridianRuntime) -> None:
        config = runtime.config
        self.runtime = runtime
        # Entropy-driven forces are known only here; hard-cap forces are counted by the
        # scheduler, which sees the same tokens and knobs (so no force is counted twice).
        # Reaches /metrics like the scheduler's metrics ($PROMETHEUS_MULTIPROC_DIR).
        self.metrics = MeridianMetrics(CollectorRegistry())
        self.forcer = ThinkForcer(
            runtime.model,
            BudgetPolicy(config.scheduler, config.entropy),
            self._count_force,
            transition=runtime.transition_ids,
        )
        self.num_errors = 0
        # Requests whose own sampling restrictions turned their forcing off (_restricted).
        self.num_restricted = 0
        self._logged: set[tuple[str, str]] = set()
        self._generation = 0
        # Wall time in step() (the per-step work between the forward pass and sampling), and
        # its calls: benchmarks/bench_vllm_overhead.py reports it per step.
        self.step_s = 0.0
        self.num_steps = 0

    def _count_force(self, record: ForceRecord) -> None:
        if record.reason is not ForceReason.HARD_CAP:
            self.metrics.count_force(record.reason)

    def new_key(self, slot: int) -> str:
        # Slots are reused; the counter keeps keys of successive occupants distinct.
        self._generation += 1
        return f"{slot}:{self._generation}"

    def budget_of(self, params: Any) -> RequestBudget | None:
        try:
            return self.runtime.request_budget(params, self._restricted)
        except ValueError as exc:
            # validate_params rejects these at admission; reaching here means the processor
            # was not consulted then (e.g. loaded differently). Documented fallback: defaults.
            logger.warning("Meridian: ignoring invalid extra_args (%s); using defaults", exc)
            return None

    def _restricted(self) -> None:
        """A request's own allowed_token_ids or bad_words forbid a token a force would emit:
        its forcing is off (the client's restriction wins); counted, and logged once."""
        self.num_restricted += 1
        if self.num_restricted == 1:
            logger.warning(
                "Meridian: a request's own allowed_token_ids or bad_words forbid a token a force "
                "emits (think_end ids %s): the client's restriction wins, forcing is off for it "
                "(further such requests are counted in num_restricted, not logged)",
                list(self.runtime.think_end_ids),
            )

    def step(self, logits: torch.Tensor, rows: list[tuple[int, str]]) -> torch.Tensor:
        """Sync, measure and force ``rows`` (``(row index, key)`` pairs) of ``logits``."""
        start = time.perf_counter()
        try:
            return self._step(logits, rows)
        finally:
            self.step_s += time.perf_counter() - start
            self.num_steps += 1

    def _step(self, logits: torch.Tensor, rows: list[tuple[int, str]]) -> torch.Tensor:
        forcer = self.forcer
        keys = [key for _, key in rows]
        wanted = forcer.prepare(keys)
        if wanted:
            index = torch.tensor(
                [rows[i][0] for i in wanted], dtype=torch.long, device=logits.device
            )
            values = entropy_torch(logits.index_select(0, index)).tolist()
            for i, h in zip(wanted, values, strict=True):
                if math.isfinite(h):
                    forcer.observe_entropy(keys[i], max(h, 0.0))
        forced = forcer.forced_tokens(keys)
        if forced:
            _force_rows(logits, [rows[i][0] for i, _ in forced], [token for _, token in forced])
        return logits

    def error(self, where: str, exc: Exception) -> None:
        self.num_errors += 1
        self.metrics.count_policy_error("logits_processor")
        key = (where, type(exc).__name__)
        if key in self._logged:
            return
        self._logged.add(key)
        logger.error(
            "Meridian logits processor error in %s; logits left untouched this step "
            "(further %s errors are counted, not logged)",
            where,
            type(exc).__name__,
            exc_info=exc,
        )


class MeridianLogitsProcessor(LogitsProcessor):
    """V1-interface processor (``vllm.v1.sample.logits_processor``), the CPU runner's.

    State per persistent-batch index: a key into the :class:`ThinkForcer`, whose output view
    is the request's live output-token list (``BatchUpdate.added``). Batch updates are applied
    in vLLM's documented order: removed, added, moved.
    """

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject bad ``meridian_*`` extra_args at admission (a ``ValueError``: HTTP 400)."""
        parse_request_budget(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.core = _ProcessorCore(runtime_from_vllm_config(vllm_config))
        self._keys: dict[int, str] = {}
        # Rows removed from the batch, by the identity of their output list (the forcer holds
        # the list, so the identity is not reused while parked), oldest first: a request that
        # comes back resumes its state. vLLM does not tell a processor that a removed request
        # finished; its runner then drops the request's state, and with it the list
        # (_release_finished). Beyond a bound the oldest are dropped anyway.
        self._parked: dict[int, str] = {}
        max_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
        self._max_parked = PARKED_PER_SEQ * (max_seqs or DEFAULT_MAX_SEQS)

    def _park(self, key: str) -> None:
        """Keep a removed row's state until its request comes back, finishes, or is the
        oldest beyond the bound."""
        parked, forcer = self._parked, self.core.forcer
        parked[id(forcer.output(key))] = key
        while len(parked) > self._max_parked:
            forcer.remove(parked.pop(next(iter(parked))))

    def _release_finished(self) -> None:
        """Drop the kept rows of requests vLLM no longer holds: nothing but the forcer refers
        to their output list any more (a list vLLM keeps for a request it will add back is
        referred to by the runner's state of that request)."""
        forcer = self.core.forcer
        gone = [
            oid
            for oid, key in self._parked.items()
            # The forcer's reference and getrefcount's own argument.
            if sys.getrefcount(forcer.output(key)) <= _OWN_REFERENCES
        ]
        for oid in gone:
            forcer.remove(self._parked.pop(oid))

    @property
    def forcer(self) -> ThinkForcer:
        """The per-request state (phase, probes, force records)."""
        return self.core.forcer

    def is_argmax_invariant(self) -> bool:
        """Forcing changes the greedy choice."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        try:
            self._apply_batch_update(batch_update)
        except Exception as exc:
            self.core.error("update_state", exc)

    def _apply_batch_update(self, batch_update: BatchUpdate) -> None:
        keys, forcer, parked = self._keys, self.core.forcer, self._parked
        for index in batch_update.removed:
            key = keys.pop(index, None)
            if key is not None:
                self._park(key)
        for index, params, prompt_ids, output_ids in batch_update.added:
            # An index removed and filled again in one update is not in ``removed``.
            old = keys.pop(index, None)
            if old is not None:
                self._park(old)
            # Back from a step out of the batch (unscheduled, or preempted and resumed): the
            # same live output list, so the same request; its state goes on.
            key = parked.pop(id(output_ids), None)
            if key is None or not forcer.resume(key, output_ids):
                if key is not None:
                    forcer.remove(key)
                key = self.core.new_key(index)
                forcer.add(
                    key,
                    prompt=prompt_ids or (),
                    output=output_ids,
                    budget=self.core.budget_of(params),
                )
            keys[index] = key
        for a, b, direction in batch_update.moved:
            key_a, key_b = keys.pop(a, None), keys.pop(b, None)
            if key_a is not None:
                keys[b] = key_a
            if key_b is not None:
                if direction == MoveDirectionality.SWAP:
                    keys[a] = key_b
                else:
                    self._park(key_b)
        if parked:
            self._release_finished()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._keys or not self.core.runtime.model.has_boundaries:
            return logits
        num_rows = logits.shape[0]
        rows = [(i, k) for i, k in self._keys.items() if i < num_rows]
        try:
            return self.core.step(logits, rows)
        except Exception as exc:
            self.core.error("apply", exc)
            return logits


try:
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsProcessor as _V2LogitsProcessor,
    )
except ImportError:  # pragma: no cover - vLLM builds without the V2 runner
    _V2LogitsProcessor = None


if _V2LogitsProcessor is not None:

    class MeridianLogitsProcessorV2(_V2LogitsProcessor):
        """V2-interface processor (``vllm.v1.worker.gpu.sample.logits_processor``).

        V2 hands processors no token lists: the committed tokens live on the device in
        ``req_states.all_token_ids`` and this step's input token of each row is
        ``ctx.input_ids``. Per row, the token at position ``pos`` (the last committed one) is
        an output token when ``pos >= prompt_len``; a request entering with several output
        tokens already (resumed after preemption) has them read from ``all_token_ids`` once.
        NOTE: this reads ``input_ids``/``pos`` to the host each step (one small device sync),
        acceptable for a first version; speculative decoding (several rows per request) is not
        supported and such rows are left untouched.
        """

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            """Reject bad ``meridian_*`` extra_args at admission (a ``ValueError``)."""
            parse_request_budget(getattr(sampling_params, "extra_args", None))

        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            super().__init__(vllm_config, req_states)
            self.req_states = req_states
            self.core = _ProcessorCore(runtime_from_vllm_config(vllm_config))
            self._keys: dict[int, str] = {}
            self._outputs: dict[int, list[int]] = {}
            self._pending: dict[int, Any] = {}

        @property
        def forcer(self) -> ThinkForcer:
            """The per-request state (phase, probes, force records)."""
            return self.core.forcer

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            old = self._keys.pop(req_idx, None)
            if old is not None:
                self.core.forcer.remove(old)
            self._outputs.pop(req_idx, None)
            # Tokens are known only at the first apply() (after the runner's staged writes).
            self._pending[req_idx] = sampling_params
            return self.core.runtime.model.has_boundaries

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            if not self.core.runtime.model.has_boundaries:
                return logits
            try:
                return self._apply(logits, ctx)
            except Exception as exc:
                self.core.error("apply", exc)
                return logits

        def _apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            slots = ctx.expanded_idx_mapping.tolist()
            if len(slots) != len(set(slots)):
                return logits  # speculative decoding: several rows per request
            positions = ctx.pos.tolist()
            inputs = ctx.input_ids.tolist()
            prompt_len = self.req_states.prompt_len.np
            rows: list[tuple[int, str]] = []
            for row, slot in enumerate(slots):
                plen = int(prompt_len[slot])
                pos = int(positions[row])
                if slot in self._pending:
                    params = self._pending.pop(slot)
                    committed = self.req_states.all_token_ids.gpu[slot, plen : pos + 1]
                    prompt = self.req_states.all_token_ids.gpu[slot, :plen].tolist()
                    output = [int(t) for t in committed.tolist()]
                    self._outputs[slot] = output
                    key = self.core.new_key(slot)
                    self.core.forcer.add(
                        key, prompt=prompt, output=output, budget=self.core.budget_of(params)
                    )
                    self._keys[slot] = key
                elif slot in self._keys:
                    output = self._outputs[slot]
                    index = pos - plen
                    if index == len(output):
                        output.append(int(inputs[row]))
                else:
                    continue
                rows.append((row, self._keys[slot]))
            return self.core.step(logits, rows)

else:  # pragma: no cover
    MeridianLogitsProcessorV2 = None  # type: ignore[assignment,misc]
