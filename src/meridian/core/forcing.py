"""Per-request think-budget forcing, as a logits processor drives it (pure Python, no torch).

A logits processor sees ``[rows, vocab]`` logits once per step and a live view of each row's
output tokens. :class:`ThinkForcer` turns that into decisions with the core objects: a
:class:`~meridian.core.router.PhaseRouter` over the row's own output tokens, an
:class:`~meridian.core.entropy.EntropyProbe` fed with the row's per-token entropy while it
thinks, and the :class:`~meridian.core.budget.BudgetPolicy`. The torch side
(:mod:`meridian.vllm.logits`) only computes entropies and masks rows.

Per step and request, in this order::

    sync(key)                 feed the tokens generated since the last step to the router
    wants_entropy(key)        THINK, forcing allowed and entropy enabled: compute H of the row
    observe_entropy(key, h)   ... and account it
    forced_token(key)         the token id to force now, or None

When the policy fires, the request is marked forced in the router (``ExitThink.forced`` will
be true) and the ``think_end`` ids are emitted one per step, so a multi-token marker (Granite's
prose) is forced whole; a configured transition phrase (``transition``, the tokens of
``scheduler.force_transition_phrase``) is emitted first, as think tokens. A request the
router already saw leave THINK is never forced. The budget counts the request's
``num_reasoning_tokens``: the think tokens its prompt already holds (a prompt whose reasoning
started, :mod:`meridian.core.router` rule 5) and those it generated.

Keys are the processor's own (e.g. the persistent-batch slot plus a generation counter). A
request that leaves the batch and comes back with the same live output view (vLLM's V1 runner
drops a request it does not schedule in a step, and re-adds it when it does) is taken back
with :meth:`ThinkForcer.resume`: its router state, entropy probe and pending marker go on. One
that comes back with another view (the V1 runner under asynchronous scheduling rebuilds it) is
added afresh: it replays its output tokens, so phase and counts are exact, but the entropy
history before is lost (the probe restarts; documented in docs/vllm.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meridian.core.budget import BudgetPolicy, ForceDecision, RequestBudget, Signals
from meridian.core.entropy import EntropyProbe
from meridian.core.router import PhaseRouter, ReasoningModel, RequestPhaseState
from meridian.core.types import ForceReason, Phase

__all__ = ["ForceRecord", "ThinkForcer"]


@dataclass(frozen=True, slots=True)
class ForceRecord:
    """One force decision: which request key, why, and at which think-token count."""

    key: str
    reason: ForceReason
    num_think_tokens: int
    detail: str


@dataclass(slots=True)
class _Row:
    """One tracked request. ``output`` is a live view that the engine appends to."""

    output: Sequence[int]
    budget: RequestBudget | None
    probe: EntropyProbe | None
    # The router's state of the request (read here, never written) and its hard cap
    # (BudgetPolicy.cap; infinite when its forcing is off).
    st: RequestPhaseState
    cap: float
    num_seen: int = 0
    # Remaining think_end ids to emit, one per step, once the policy fired.
    pending: list[int] = field(default_factory=list)


def _forcible(st: RequestPhaseState) -> bool:
    """The request thinks and was not forced yet (the router's ``can_mark_forced``)."""
    return st.phase is Phase.THINK and st.forced is None


def _wants_entropy(row: _Row) -> bool:
    """This step's entropy of the row would be used: it has a probe, no marker is being
    forced, and it may still be forced."""
    return row.probe is not None and not row.pending and _forcible(row.st)


class ThinkForcer:
    """Decides, per request and step, whether to force ``think_end`` (see module docstring).

    ``on_force`` is called with every decision (metrics); ``records`` keeps the last 256.

    Invariant (``check_integrity``): every tracked key is tracked by the router, and each
    row's ``num_seen`` equals the router's ``num_generated_tokens`` for it.

    >>> model = ReasoningModel(think_start=(3,), think_end=(4,))
    >>> forcer = ThinkForcer(model, BudgetPolicy.static(2))
    >>> out = []
    >>> forcer.add("r", prompt=[9, 3], output=out, budget=None)
    >>> forcer.sync("r")
    <Phase.THINK: 1>
    >>> forcer.forced_token("r") is None
    True
    >>> out += [7, 8]
    >>> forcer.sync("r"), forcer.forced_token("r")
    (<Phase.THINK: 1>, 4)
    """

    def __init__(
        self,
        model: ReasoningModel,
        policy: BudgetPolicy,
        on_force: Callable[[ForceRecord], None] | None = None,
        transition: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.policy = policy
        self.on_force = on_force
        self.transition = tuple(transition)
        self.router = PhaseRouter()
        self._rows: dict[str, _Row] = {}
        # The most recent decisions (bounded: the processor lives as long as the server).
        self.records: deque[ForceRecord] = deque(maxlen=256)
        self.num_forced: dict[ForceReason, int] = dict.fromkeys(ForceReason, 0)

    # -- lifecycle ----------------------------------------------------------------------------

    def add(
        self,
        key: str,
        *,
        prompt: Sequence[int],
        output: Sequence[int],
        budget: RequestBudget | None,
    ) -> None:
        """Track a request entering the batch; ``output`` may already hold tokens (resumed)."""
        if key in self._rows:
            self.remove(key)
        self.router.start(key, self.model, prompt)
        # No probe (no per-token entropy work) where no entropy signal may force the request.
        entropy_may_force = budget is None or (
            budget.forcing and budget.signals is not Signals.NONE
        )
        probe = self.policy.new_probe() if entropy_may_force and self.model.has_boundaries else None
        cap = self.policy.cap(budget)
        self._rows[key] = _Row(
            output=output,
            budget=budget,
            probe=probe,
            st=self.router.state(key),
            cap=math.inf if cap is None else cap,
        )
        self.sync(key)

    def remove(self, key: str) -> None:
        """Stop tracking ``key`` (finished, aborted or preempted). Unknown keys are ignored."""
        if self._rows.pop(key, None) is not None:
            self.router.finish(key)

    def output(self, key: str) -> Sequence[int]:
        """The live output view ``key`` was added with."""
        return self._rows[key].output

    def resume(self, key: str, output: Sequence[int]) -> bool:
        """Take back ``key``, kept while its request was out of the batch, if ``output`` is the
        live view it was added with and still holds every token seen (tokens generated since
        are fed); False (nothing changed) otherwise: the caller starts it afresh."""
        row = self._rows.get(key)
        if row is None or row.output is not output or len(output) < row.num_seen:
            return False
        self.sync(key)
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    # -- per step -----------------------------------------------------------------------------

    def sync(self, key: str) -> Phase:
        """Feed the tokens appended to the request's output since the last call; its phase."""
        self.prepare((key,))
        return self._rows[key].st.phase

    def prepare(self, keys: Sequence[str]) -> list[int]:
        """One step's :meth:`sync` of every key (their new tokens go to the router in one
        batch); returns the positions in ``keys`` of those that :meth:`wants_entropy`."""
        rows = [self._rows[key] for key in keys]
        states: list[RequestPhaseState] = []
        deltas: list[Sequence[int]] = []
        for row in rows:
            output, seen = row.output, row.num_seen
            n = len(output)
            if n > seen:
                states.append(row.st)
                deltas.append(output[seen:n])
                row.num_seen = n
        if states:
            self.router.observe_states(states, deltas)
        return [i for i, row in enumerate(rows) if _wants_entropy(row)]

    def forced_tokens(self, keys: Sequence[str]) -> list[tuple[int, int]]:
        """One step's :meth:`forced_token` of every key: ``(position in keys, token id)`` for
        each that must emit a token now. A thinking request the policy cannot fire on
        (:meth:`~meridian.core.budget.BudgetPolicy.cannot_fire`) is passed over without asking."""
        forced: list[tuple[int, int]] = []
        rows, cannot_fire = self._rows, self.policy.cannot_fire
        for i, key in enumerate(keys):
            row = rows[key]
            st = row.st
            if not row.pending and (
                not _forcible(st) or cannot_fire(st.num_reasoning_tokens, row.cap, row.probe)
            ):
                continue
            token = self.forced_token(key)
            if token is not None:
                forced.append((i, token))
        return forced

    def wants_entropy(self, key: str) -> bool:
        """True when this step's entropy of the request's row would be used."""
        return _wants_entropy(self._rows[key])

    def observe_entropy(self, key: str, entropy: float) -> None:
        """Account the entropy (nats) of the distribution the request samples from now."""
        probe = self._rows[key].probe
        if probe is not None:
            probe.observe(entropy)

    def forced_token(self, key: str) -> int | None:
        """The token id the request must emit now, or ``None`` to sample freely.

        Calls the budget policy while the request thinks and was not forced yet; once it
        fires, returns the ``think_end`` ids one per call until the marker is out.
        """
        row = self._rows[key]
        if row.pending:
            return row.pending.pop(0)
        st = row.st
        if not _forcible(st):
            return None
        decision: ForceDecision | None = self.policy.decide(
            st.num_reasoning_tokens, row.probe, row.budget
        )
        if decision is None:
            return None
        self.router.mark_forced(key, decision.reason)
        self.num_forced[decision.reason] += 1
        record = ForceRecord(key, decision.reason, decision.num_think_tokens, decision.detail)
        self.records.append(record)
        if self.on_force is not None:
            self.on_force(record)
        # A partly generated multi-token marker is completed, not restarted (and then
        # the transition phrase would split it, so it is left out).
        ids = self.model.think_end
        if st.marker_progress:
            row.pending = list(ids[st.marker_progress :])
        else:
            row.pending = [*self.transition, *ids]
        return row.pending.pop(0)

    def phase(self, key: str) -> Phase:
        """The request's phase as of the last ``sync``."""
        return self.router.phase(key)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        self.router.check_integrity()
        if self.router.tracked_requests != len(self._rows):
            raise AssertionError(
                f"router tracks {self.router.tracked_requests} requests, forcer {len(self._rows)}"
            )
        for key, row in self._rows.items():
            generated = self.router.state(key).num_generated_tokens
            if generated != row.num_seen:
                raise AssertionError(f"{key!r}: router saw {generated} tokens, row {row.num_seen}")
            if row.probe is not None:
                row.probe.check_integrity()
