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

Length: the V1 and V2 processors share one core (:class:`_ProcessorCore`) and each
adapts it to its runner's interface; splitting them would put the shared core in a third module
only they import.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from meridian.core.budget import BudgetPolicy, RequestBudget
from meridian.core.forcing import ForceRecord, ThinkForcer
from meridian.core.types import ForceReason
from meridian.telemetry.metrics import MeridianMetrics
from meridian.vllm.failopen import FailOpen
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


@dataclass(frozen=True, slots=True)
class _Drafts:
    """One request's draft rows in a step (speculative decoding): their row indices and input
    tokens, in order (row ``j`` sees the committed tokens and ``tokens[: j + 1]``)."""

    key: str
    rows: list[int]
    tokens: list[int]


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
            runtime.format,
            BudgetPolicy(config.scheduler, config.entropy),
            self._count_force,
            transition=runtime.transition_ids,
        )
        self.fail_open = FailOpen(
            self.metrics, logger, "logits processor", metric_hook="logits_processor"
        )
        # Requests whose own sampling restrictions turned their forcing off (_restricted).
        self.num_restricted = 0
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

    def step(
        self, logits: torch.Tensor, rows: list[tuple[int, str]], drafts: Sequence[_Drafts] = ()
    ) -> torch.Tensor:
        """Sync, measure and force ``rows`` (``(row index, key)`` pairs: each request's row of
        its last committed token) of ``logits``; then the ``drafts`` rows (speculative decoding,
        :class:`_Drafts`)."""
        start = time.perf_counter()
        try:
            return self._step(logits, rows, drafts)
        finally:
            self.step_s += time.perf_counter() - start
            self.num_steps += 1

    def _step(
        self, logits: torch.Tensor, rows: list[tuple[int, str]], drafts: Sequence[_Drafts]
    ) -> torch.Tensor:
        forcer = self.forcer
        keys = [key for _, key in rows]
        wanted = forcer.prepare(keys)
        measured = [rows[i][0] for i in wanted]
        # Draft rows are measured with the others (one kernel, one read) when they may count.
        spec = [d for d in drafts if forcer.wants_draft_entropy(d.key)]
        for d in spec:
            measured.extend(d.rows)
        values: list[float] = []
        if measured:
            index = torch.tensor(measured, dtype=torch.long, device=logits.device)
            values = entropy_torch(logits.index_select(0, index)).tolist()
            for i, h in zip(wanted, values[: len(wanted)], strict=True):
                if math.isfinite(h):
                    forcer.observe_entropy(keys[i], max(h, 0.0))
        forced = forcer.forced_tokens(keys)
        force_rows = [rows[i][0] for i, _ in forced]
        force_ids = [token for _, token in forced]
        if drafts:
            entropies: dict[str, list[float]] = {}
            at = len(wanted)
            for d in spec:
                entropies[d.key] = values[at : at + len(d.rows)]
                at += len(d.rows)
            for d in drafts:
                hs = entropies.get(d.key) or [math.nan] * len(d.rows)
                for row, token in zip(d.rows, forcer.speculate(d.key, d.tokens, hs), strict=True):
                    if token is not None:
                        force_rows.append(row)
                        force_ids.append(token)
        if force_rows:
            _force_rows(logits, force_rows, force_ids)
        return logits

    @property
    def num_errors(self) -> int:
        """Exceptions in Meridian's per-step code that left the logits untouched (failed open)."""
        num_errors: int = self.fail_open.num_errors
        return num_errors

    def error(self, where: str, exc: Exception) -> None:
        """Fail open: count and log (once per kind) an exception in ``where``; the logits of
        that step are left untouched by the caller."""
        self.fail_open.error(where, exc)


class _ValidatesKnobs:
    """Both processors' ``validate_params``: reject bad ``meridian_*`` extra_args at admission
    (a ``ValueError``: HTTP 400 for that request). The front doors check the same knobs as sent
    (:func:`meridian.vllm.http.check_knobs`)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        parse_request_budget(getattr(sampling_params, "extra_args", None))


class MeridianLogitsProcessor(_ValidatesKnobs, LogitsProcessor):
    """V1-interface processor (``vllm.v1.sample.logits_processor``), the CPU runner's.

    State per persistent-batch index: a key into the :class:`ThinkForcer`, whose output view
    is the request's live output-token list (``BatchUpdate.added``). Batch updates are applied
    in vLLM's documented order: removed, added, moved.
    """

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
        if not self._keys or not self.core.runtime.format.has_boundaries:
            return logits
        num_rows = logits.shape[0]
        rows = [(i, k) for i, k in self._keys.items() if i < num_rows]
        try:
            return self.core.step(logits, rows)
        except Exception as exc:
            self.core.error("apply", exc)
            return logits


@dataclass(frozen=True, slots=True)
class _StepRows:
    """One request's rows in a V2 step: the row of its last committed token (``row``, at
    ``pos``, input ``token``) and its draft rows with their input tokens."""

    slot: int
    row: int
    pos: int
    token: int
    draft_rows: list[int]
    draft_tokens: list[int]


def _step_rows(
    slots: list[int],
    local_pos: list[int],
    positions: list[int],
    inputs: list[int],
    prefill_len: Any,
) -> list[_StepRows]:
    """The requests of a V2 step from its layout read to the host (``LogitsContext``'s
    ``expanded_idx_mapping``, ``expanded_local_pos``, ``pos``, ``input_ids``): a request's rows
    are consecutive, offset 0 first. A request whose row is not its prompt's last (a chunk of
    a prefill: no token is sampled) is left out; its drafts end at a placeholder (``-1``)."""
    requests: list[_StepRows] = []
    current: _StepRows | None = None
    stopped = False
    for row, slot in enumerate(slots):
        if local_pos[row] == 0:
            pos = positions[row]
            current = None
            if pos + 1 >= int(prefill_len[slot]):
                current = _StepRows(slot, row, pos, inputs[row], [], [])
                requests.append(current)
            stopped = False
        elif current is not None and slot == current.slot and not stopped:
            token = inputs[row]
            if token < 0:
                stopped = True
            else:
                current.draft_rows.append(row)
                current.draft_tokens.append(token)
    return requests


try:
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsProcessor as _V2LogitsProcessor,
    )
except ImportError:  # pragma: no cover - vLLM builds without the V2 runner
    _V2LogitsProcessor = None


if _V2LogitsProcessor is not None:

    class MeridianLogitsProcessorV2(_ValidatesKnobs, _V2LogitsProcessor):
        """V2-interface processor (``vllm.v1.worker.gpu.sample.logits_processor``).

        V2 hands processors no token lists: the committed tokens live on the device in
        ``req_states.all_token_ids`` (valid up to ``total_len``), and a step's rows are
        described by the ``LogitsContext``: per row its request slot
        (``expanded_idx_mapping``), its offset among its request's rows
        (``expanded_local_pos``), its position and its input token. A request's first row
        (offset 0) is that of its last committed token, at position ``total_len - 1``; under
        speculative decoding each further row is a draft token's (vLLM's own V2
        ``thinking_budget`` reads the rows the same way).

        Per step: the step's layout is read to the host at once (one small device sync); each
        request's output view is brought up to its first row's position, with the row's input
        token when one token is new (the common step) and from ``all_token_ids`` when several
        are (accepted drafts, a request resumed with output tokens, read in one batch); the
        first rows go through the shared step (:class:`_ProcessorCore`) and the draft rows
        through :meth:`ThinkForcer.speculate` (each row sees the drafts before it; the drafts
        the engine accepts are settled at the next step from the committed tokens, so rejected
        ones leave no trace). Rows of a request still prefilling (no token sampled) and
        placeholder drafts (``-1``) are left untouched.
        """

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
            return self.core.runtime.format.has_boundaries

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            if not self.core.runtime.format.has_boundaries:
                return logits
            try:
                return self._apply(logits, ctx)
            except Exception as exc:
                self.core.error("apply", exc)
                return logits

        def _apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            # The step's layout on the host: one read (one device sync).
            slots, local_pos, positions, inputs = torch.stack(
                (
                    ctx.expanded_idx_mapping.long(),
                    ctx.expanded_local_pos.long(),
                    ctx.pos.long(),
                    ctx.input_ids.long(),
                )
            ).tolist()
            req_states, keys, outputs = self.req_states, self._keys, self._outputs
            prompt_len = req_states.prompt_len.np
            # Token ranges to read from the device in one batch, (slot, start, end), and this
            # step's requests, each with whether it has a range there.
            reads: list[tuple[int, int, int]] = []
            requests: list[tuple[_StepRows, bool]] = []
            for req in _step_rows(slots, local_pos, positions, inputs, req_states.prefill_len.np):
                slot = req.slot
                if slot in self._pending:
                    reads.append((slot, 0, req.pos + 1))  # the prompt and any output
                    requests.append((req, True))
                elif slot in keys:
                    output, plen = outputs[slot], int(prompt_len[slot])
                    new = req.pos + 1 - plen - len(output)
                    if new == 1:  # the common step: the row's input is the new token
                        output.append(req.token)
                    elif new > 1:  # accepted drafts (or resumed): from the device
                        reads.append((slot, plen + len(output), req.pos + 1))
                    requests.append((req, new > 1))
            read = iter(self._read(reads))
            rows: list[tuple[int, str]] = []
            drafts: list[_Drafts] = []
            for req, has_read in requests:
                slot = req.slot
                if slot in self._pending:
                    params = self._pending.pop(slot)
                    plen = int(prompt_len[slot])
                    history = next(read)
                    output = outputs[slot] = history[plen:]
                    key = keys[slot] = self.core.new_key(slot)
                    self.core.forcer.add(
                        key,
                        prompt=history[:plen],
                        output=output,
                        budget=self.core.budget_of(params),
                    )
                else:
                    key = keys[slot]
                    if has_read:
                        outputs[slot].extend(next(read))
                rows.append((req.row, key))
                if req.draft_rows:
                    drafts.append(_Drafts(key, req.draft_rows, req.draft_tokens))
            return self.core.step(logits, rows, drafts)

        def _read(self, reads: list[tuple[int, int, int]]) -> list[list[int]]:
            """The committed tokens ``[start, end)`` of each ``(slot, start, end)``, read from
            ``all_token_ids`` in one gather (one device read)."""
            if not reads:
                return []
            ids = self.req_states.all_token_ids.gpu
            slots = [slot for slot, start, end in reads for _ in range(start, end)]
            cols = [col for _, start, end in reads for col in range(start, end)]
            device = ids.device
            flat = ids[
                torch.tensor(slots, dtype=torch.long, device=device),
                torch.tensor(cols, dtype=torch.long, device=device),
            ].tolist()
            chunks: list[list[int]] = []
            at = 0
            for _, start, end in reads:
                chunks.append(flat[at : at + end - start])
                at += end - start
            return chunks

else:  # pragma: no cover
    MeridianLogitsProcessorV2 = None  # type: ignore[assignment,misc]
