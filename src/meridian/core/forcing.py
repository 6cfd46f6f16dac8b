"""Per-request think-budget forcing, as a logits processor drives it (pure Python, no torch).

A logits processor sees ``[rows, vocab]`` logits once per step and a live view of each row's
output tokens. :class:`ThinkForcer` turns that into decisions with the core objects: a
:class:`~meridian.core.state.RequestState` of the row's own output tokens, an
:class:`~meridian.core.signals.EntropyProbe` fed with the row's per-token entropy while it
thinks, and the :class:`~meridian.core.budget.BudgetPolicy`. The torch side
(:mod:`meridian.vllm.logits`) only computes entropies and masks rows.

Per step and request, in this order::

    sync(key)                 advance the request's state over the tokens since the last step
    wants_entropy(key)        THINK, forcing allowed and entropy enabled: compute H of the row
    observe_entropy(key, h)   ... and account it
    forced_token(key)         the token id to force now, or None

When the policy fires, the request's state is marked forced (``ExitThink.forced`` will
be true) and the ``think_end`` ids are emitted one per step, so a multi-token marker (Granite's
prose) is forced whole; a configured transition phrase (``transition``, the tokens of
``scheduler.force_transition_phrase``) is emitted first, as think tokens. A request the
state already left THINK is never forced. The budget counts the request's
``num_reasoning_tokens``: the think tokens its prompt already holds (a prompt whose reasoning
started, :mod:`meridian.core.format` rule 5) and those it generated.

Keys are the processor's own (e.g. the persistent-batch slot plus a generation counter). A
request that leaves the batch and comes back with the same live output view (vLLM's V1 runner
drops a request it does not schedule in a step, and re-adds it when it does) is taken back
with :meth:`ThinkForcer.resume`: its state, entropy probe and pending marker go on. One
that comes back with another view (the V1 runner under asynchronous scheduling rebuilds it) is
added afresh: it replays its output tokens, so phase and counts are exact, but the entropy
history before is lost (the probe restarts; documented in docs/vllm.md).

Speculative decoding: a request then has several logits rows in one step, the row of its last
committed token and one row per draft token; row ``j`` sees the committed tokens and the first
``j`` drafts. After the step's own decision (the first row, as above), :meth:`ThinkForcer.
speculate` walks the draft rows on a copy of the request's state (phase state, probe, pending
marker) and returns the token to force on each: the rule is the same one, fed one draft at a
time. The drafts and their rows' entropies are kept; at the next sync the draft rows whose
token the engine accepted (the new committed tokens start with those drafts) are replayed on
the request's own state, each as a step of its own (its token, its entropy, its decision,
records and counters included), so the request ends in the state one-token steps would have
left it in. Rejected drafts leave no trace.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meridian.core.budget import BudgetPolicy, ForceDecision, RequestBudget, Signals
from meridian.core.format import ReasoningFormat
from meridian.core.signals import EntropyProbe
from meridian.core.state import (
    RequestState,
    advance,
    advance_many,
    integrity_problem,
    mark_forced,
    set_thought,
    start,
)
from meridian.core.types import ForceReason, Phase

__all__ = ["ForceRecord", "ThinkForcer"]

# Phases in which a request may still be forced (PREFILL: its first tokens may open THINK).
_UNDECIDED = frozenset({Phase.PREFILL, Phase.THINK})


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
    # The request's state (advanced by this forcer alone) and its hard cap
    # (BudgetPolicy.cap; infinite when its forcing is off).
    st: RequestState
    cap: float
    num_seen: int = 0
    # Remaining think_end ids to emit, one per step, once the policy fired.
    pending: list[int] = field(default_factory=list)
    # The last step's draft tokens (speculative decoding) and their rows' entropies (NaN: not
    # measured), kept until the next sync tells which were accepted (ThinkForcer.speculate).
    drafts: Sequence[int] = ()
    draft_entropies: Sequence[float] = ()


def _forcible(st: RequestState) -> bool:
    """The request thinks and was not forced yet (``mark_forced`` is allowed)."""
    return st.phase is Phase.THINK and st.forced is None


def _wants_entropy(row: _Row) -> bool:
    """This step's entropy of the row would be used: it has a probe, no marker is being
    forced, and it may still be forced."""
    return row.probe is not None and not row.pending and _forcible(row.st)


def _may_decide(row: _Row) -> bool:
    """A later token of the request may be forced or have its entropy used: a marker is being
    forced, or the request thinks (or may still start thinking) and was not forced."""
    st = row.st
    return bool(row.pending) or (st.forced is None and st.phase in _UNDECIDED)


class ThinkForcer:
    """Decides, per request and step, whether to force ``think_end`` (see module docstring).

    ``on_force`` is called with every decision (metrics); ``records`` keeps the last 256.

    Invariant (``check_integrity``): each row's state is consistent and its ``num_seen`` equals
    the state's ``num_generated_tokens``.

    >>> fmt = ReasoningFormat(think_start=(3,), think_end=(4,))
    >>> forcer = ThinkForcer(fmt, BudgetPolicy.static(2))
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
        fmt: ReasoningFormat,
        policy: BudgetPolicy,
        on_force: Callable[[ForceRecord], None] | None = None,
        transition: Sequence[int] = (),
    ) -> None:
        self.format = fmt
        self.policy = policy
        self.on_force = on_force
        self.transition = tuple(transition)
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
        # No probe (no per-token entropy work) where no entropy signal may force the request.
        entropy_may_force = budget is None or (
            budget.forcing and budget.signals is not Signals.NONE
        )
        probe = (
            self.policy.new_probe() if entropy_may_force and self.format.has_boundaries else None
        )
        cap = self.policy.cap(budget)
        self._rows[key] = _Row(
            output=output,
            budget=budget,
            probe=probe,
            st=start(key, self.format, prompt),
            cap=math.inf if cap is None else cap,
        )
        self.sync(key)

    def remove(self, key: str) -> None:
        """Stop tracking ``key`` (finished, aborted or preempted). Unknown keys are ignored."""
        self._rows.pop(key, None)

    def state(self, key: str) -> RequestState:
        """The phase state of ``key`` as of the tokens seen so far."""
        return self._rows[key].st

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
        """One step's :meth:`sync` of every key (their states advance over their new tokens in one
        batch); returns the positions in ``keys`` of those that :meth:`wants_entropy`."""
        rows = [self._rows[key] for key in keys]
        states: list[RequestState] = []
        deltas: list[Sequence[int]] = []
        for key, row in zip(keys, rows, strict=True):
            if row.drafts:
                self._settle_drafts(key, row)
            output, seen = row.output, row.num_seen
            n = len(output)
            if n > seen:
                states.append(row.st)
                deltas.append(output[seen:n])
                row.num_seen = n
        if states:
            advance_many(states, deltas)
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

    def wants_draft_entropy(self, key: str) -> bool:
        """True when the entropies of the request's draft rows this step may be used (by
        :meth:`speculate`, after this step's :meth:`forced_tokens`): a caller measures them only
        then."""
        return _may_decide(self._rows[key])

    def speculate(
        self, key: str, drafts: Sequence[int], entropies: Sequence[float]
    ) -> list[int | None]:
        """The token to force on each draft row of the request this step (``None``: sample
        freely), after this step's :meth:`forced_tokens`. Row ``j`` (``drafts[j]`` its input,
        ``entropies[j]`` the entropy of its logits, NaN when not measured) sees the committed
        tokens and ``drafts[: j + 1]``.

        Decided on a copy of the request's state: nothing is recorded, no counter moves. The
        drafts and entropies are kept; the next sync replays the rows of the drafts the engine
        accepted on the request's own state (module docstring). A row after one forced to a
        token other than its draft is moot (the engine rejects that draft), and is decided all
        the same.
        """
        if len(drafts) != len(entropies):
            raise ValueError(f"{len(drafts)} draft tokens but {len(entropies)} entropies")
        row = self._rows[key]
        if not drafts or not _may_decide(row):
            row.drafts = row.draft_entropies = ()
            return [None] * len(drafts)
        row.drafts, row.draft_entropies = tuple(drafts), tuple(entropies)
        scratch = _Row(
            output=(),
            budget=row.budget,
            probe=row.probe,
            st=copy.copy(row.st),
            cap=row.cap,
            pending=list(row.pending),
        )
        probe_copied = False
        cannot_fire = self.policy.cannot_fire
        forced: list[int | None] = []
        for token, entropy in zip(drafts, entropies, strict=True):
            advance(scratch.st, (token,))
            if math.isfinite(entropy) and _wants_entropy(scratch):
                assert scratch.probe is not None  # (_wants_entropy)
                if not probe_copied:
                    scratch.probe, probe_copied = scratch.probe.copy(), True
                scratch.probe.observe(max(entropy, 0.0))
            st = scratch.st
            if not scratch.pending and (
                not _forcible(st)
                or cannot_fire(st.num_reasoning_tokens, scratch.cap, scratch.probe)
            ):
                forced.append(None)
                continue
            token_now, decision = self._next_token(scratch)
            if decision is not None:
                mark_forced(st, decision.reason)  # (the copy's; the request's is not touched)
            forced.append(token_now)
        return forced

    def _settle_drafts(self, key: str, row: _Row) -> None:
        """Replay the last step's draft rows the engine accepted, each as a step of its own:
        row ``j`` counts when the new tokens start with ``drafts[: j + 1]`` and one more token
        follows (its own sample). The other new tokens are left to the caller's sync."""
        drafts, entropies = row.drafts, row.draft_entropies
        row.drafts = row.draft_entropies = ()
        output, seen = row.output, row.num_seen
        limit = min(len(drafts), len(output) - seen - 1)
        accepted = 0
        while accepted < limit and output[seen + accepted] == drafts[accepted]:
            accepted += 1
        for token, entropy in zip(drafts[:accepted], entropies[:accepted], strict=True):
            advance(row.st, (token,))
            row.num_seen += 1
            if math.isfinite(entropy) and _wants_entropy(row):
                assert row.probe is not None  # (_wants_entropy)
                row.probe.observe(max(entropy, 0.0))
            # The decision that row took (its token was forced then): recorded now.
            self.forced_token(key)

    def replay(
        self, entropies: Sequence[float] | None, num_think: int
    ) -> tuple[int, ForceReason | None]:
        """The think length of a request that would think ``num_think`` tokens whose rows'
        entropies are ``entropies`` (``None``: none measured, only the hard cap can fire), and
        why it was cut short: what this forcer decides for it step by step, as a logits
        processor would (the simulator's trace forcing). Nothing is recorded or counted.

        >>> fmt = ReasoningFormat(think_start=(3,), think_end=(4,))
        >>> ThinkForcer(fmt, BudgetPolicy.static(5)).replay(None, 9)
        (5, <ForceReason.HARD_CAP: 'hard_cap'>)
        """
        policy = self.policy
        row = _Row(
            output=(),
            budget=None,
            probe=policy.new_probe() if entropies is not None else None,
            st=RequestState("replay", self.format, Phase.THINK),
            cap=policy.max_think_tokens,
        )
        st, probe, cannot_fire, cap = row.st, row.probe, policy.cannot_fire, row.cap
        # Until a decision, the row thinks, unforced, with nothing pending: every step's entropy
        # is wanted (_wants_entropy), and only the count moves (set before each decision).
        observe = None if probe is None else probe.observe
        for k in range(num_think):
            if observe is not None:
                assert entropies is not None
                observe(max(entropies[k], 0.0))
            if not cannot_fire(k, cap, probe):
                set_thought(st, k)
                _, decision = self._next_token(row)
                if decision is not None:
                    return k, decision.reason
        return num_think, None

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
        token, decision = self._next_token(row)
        if decision is not None:
            mark_forced(row.st, decision.reason)
            self.num_forced[decision.reason] += 1
            record = ForceRecord(key, decision.reason, decision.num_think_tokens, decision.detail)
            self.records.append(record)
            if self.on_force is not None:
                self.on_force(record)
        return token

    def _next_token(self, row: _Row) -> tuple[int | None, ForceDecision | None]:
        """The token ``row`` must emit now and the policy's decision if it fired just now (for
        the caller to record); ``row.pending`` is updated. The one place the rule lives."""
        if row.pending:
            return row.pending.pop(0), None
        st = row.st
        if not _forcible(st):
            return None, None
        decision = self.policy.decide(st.num_reasoning_tokens, row.probe, row.budget)
        if decision is None:
            return None, None
        # A partly generated multi-token marker is completed, not restarted (and then
        # the transition phrase would split it, so it is left out).
        ids = self.format.think_end
        if st.marker_progress:
            row.pending = list(ids[st.marker_progress :])
        else:
            row.pending = [*self.transition, *ids]
        return row.pending.pop(0), decision

    def phase(self, key: str) -> Phase:
        """The request's phase as of the last ``sync``."""
        return self._rows[key].st.phase

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        for key, row in self._rows.items():
            problem = integrity_problem(row.st)
            if problem is not None:
                raise AssertionError(f"{key!r}: {problem}")
            generated = row.st.num_generated_tokens
            if generated != row.num_seen:
                raise AssertionError(f"{key!r}: state saw {generated} tokens, row {row.num_seen}")
            if len(row.drafts) != len(row.draft_entropies):
                raise AssertionError(
                    f"{key!r}: {len(row.drafts)} drafts kept with "
                    f"{len(row.draft_entropies)} entropies"
                )
            if row.probe is not None:
                row.probe.check_integrity()
