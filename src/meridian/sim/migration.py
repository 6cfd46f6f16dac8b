"""The cluster simulator's migrations: the mechanics of moving a request between fast-engine
replicas, over the decisions of :class:`~meridian.core.migration.MigrationPolicy`.

The routers ``meridian-replace``, ``meridian-move`` and ``meridian-split``
(:mod:`meridian.sim.routers`) are Meridian's router (hold never) with a :class:`Migrator`:

- ``replace``: a request preempted on a replica (told by the engine as it happens), or found
  waiting there longer than ``max_wait_s`` (looked for at every stats refresh), is taken off it
  (:meth:`~meridian.sim.engine.Engine.take`) and adopted by the target at once without its KV
  (:meth:`~meridian.sim.engine.Engine.adopt`): the target's prefill recomputes its prompt and
  generated tokens before it decodes again.
- ``move``: a request whose ``</think>`` was just generated on a replica under pressure moves to
  one with room: its KV (every token computed so far, times the model's KV bytes a token) sent
  over the link, arriving ``bytes / link_bytes_per_s`` later and joining the target's running
  requests then if its blocks are free (else it waits and recomputes), or recomputed there when
  the prefill (the step model's time for its tokens, alone, in chunks of the step's token
  budget) is quicker than the link. The source's blocks are freed when it leaves (an
  optimistic bound: a real copy holds them until it ends); the step in flight loses its token.
  ``meridian-split`` is ``move`` under a policy with a split: every ``</think>`` on a thinking
  replica moves to the answer-first replica with the most room (the router places new requests
  by the same split).

Each move is told to the router (:meth:`~meridian.core.routing.RoutingPolicy.routed` moves it) and
counted by reason; the engine only ever sees one request in one place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from meridian.core.migration import MigrationPolicy, Reason, Transfer
from meridian.core.policy import TrackingPolicy
from meridian.core.routing import NewRequest
from meridian.errors import MeridianError
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.state import RequestStatus, SimRequest
from meridian.sim.steptime import BatchShape, StepTimeModel

__all__ = ["MIGRATIONS", "MigrationCounts", "Migrator"]

NS = 1_000_000_000
# The migration each router name adds to Meridian's router.
MIGRATIONS = {"meridian-replace": "replace", "meridian-move": "move", "meridian-split": "move"}


@dataclass(slots=True)
class MigrationCounts:
    """What a run's migrations did: moves by reason, by transfer, and the link's seconds."""

    by_reason: Counter[str] = field(default_factory=Counter)
    by_transfer: Counter[str] = field(default_factory=Counter)
    transfer_s: float = 0.0


def remaining_request(req: SimRequest) -> NewRequest:
    """What a target replica must take of ``req``: its prompt and generated tokens as the
    prompt, the rest of its bound, its phase now."""
    return NewRequest(req.phase, req.num_tokens, max(1, req.max_tokens - req.num_output_tokens))


class Migrator:
    """Moves requests between the replicas' engines (module docstring)."""

    def __init__(
        self,
        policy: MigrationPolicy,
        mode: str,
        *,
        kv_bytes_per_token: float,
        step_model: StepTimeModel,
        engine_config: EngineConfig,
    ) -> None:
        if mode not in ("replace", "move"):
            raise MeridianError(f"unknown migration {mode!r}; known: replace, move")
        self.policy = policy
        self.mode = mode
        self.kv_bytes_per_token = kv_bytes_per_token
        self.step_model = step_model
        self.chunk_tokens = engine_config.max_num_batched_tokens
        self.counts = MigrationCounts()
        self.engines: list[Engine] = []
        self.names: list[str] = []
        self._events: list[tuple[int, SimRequest, Reason]] = []
        # When each request was last placed, preempted or adopted where it is (its wait there).
        self._since_ns: dict[str, int] = {}
        self._moves: Counter[str] = Counter()
        self._where: Callable[[str], int] = lambda _: -1
        self._moved: Callable[[str, int, NewRequest, int], None] = lambda *_: None

    def attach(
        self,
        engines: list[Engine],
        names: list[str],
        where: Callable[[str], int],
        moved: Callable[[str, int, NewRequest, int], None],
    ) -> None:
        """Drive ``engines`` (replica ``k`` is ``engines[k]``, the router's ``names[k]``);
        ``where(request_id)``: the replica a request is on; ``moved(request_id, target,
        request, now_ns)``: the cluster's record of a move (and the router's)."""
        self.engines, self.names, self._where, self._moved = engines, names, where, moved
        for k, engine in enumerate(engines):
            engine.on_preempted = lambda req, k=k: self._events.append((k, req, Reason.PREEMPTED))
            if self.mode == "move":
                engine.on_answer = lambda req, k=k: self._events.append((k, req, Reason.ANSWER))
            engine.on_adopt = lambda req, engine=engine: _track(engine, req)

    # -- between events (the cluster calls these once the engines reached now) ----------------

    def act(self, now_ns: int) -> None:
        """Decide on the preemptions and ``</think>`` tokens the engines reported."""
        events, self._events = self._events, []
        seen: set[str] = set()
        for k, req, reason in events:
            if req.request_id in seen or req.status is RequestStatus.FINISHED:
                continue
            seen.add(req.request_id)
            if self._where(req.request_id) != k:
                continue
            if reason is Reason.PREEMPTED:
                self._since_ns[req.request_id] = now_ns
                if self.mode == "replace":
                    self._replace(k, req, now_ns, preempted=True)
            else:
                self._move_answer(k, req, now_ns)

    def scan_waits(self, now_ns: int) -> None:
        """Re-place the requests waiting on a replica longer than the bound (``replace``)."""
        if self.mode != "replace":
            return
        bound_ns = self.policy.config.max_wait_s * NS
        for k, engine in enumerate(self.engines):
            for req in engine.queued():
                since = self._since_ns.get(req.request_id, req.stream.spec.arrival_ns)
                if now_ns - since > bound_ns:
                    self._replace(k, req, now_ns, preempted=False)

    # -- the moves ---------------------------------------------------------------------------

    def _replace(self, k: int, req: SimRequest, now_ns: int, *, preempted: bool) -> None:
        request = remaining_request(req)
        since = self._since_ns.get(req.request_id, req.stream.spec.arrival_ns)
        decision = self.policy.replace(
            self.names[k],
            self.names,
            request,
            now_ns / NS,
            preempted=preempted,
            waited_s=(now_ns - since) / NS,
            num_moves=self._moves[req.request_id],
        )
        if decision is not None:
            reason, target = decision
            self._move(
                k, self.names.index(target), req, request, now_ns, reason, Transfer.RECOMPUTE
            )

    def _move_answer(self, k: int, req: SimRequest, now_ns: int) -> None:
        request = remaining_request(req)
        target = self.policy.move_answer(
            self.names[k], self.names, request, now_ns / NS, num_moves=self._moves[req.request_id]
        )
        if target is None:
            return
        kv_bytes = req.num_computed_tokens * self.kv_bytes_per_token
        transfer, seconds = self.policy.transfer(kv_bytes, self.recompute_s(req.num_tokens))
        if transfer is Transfer.LINK:
            self.counts.transfer_s += seconds
        delay_ns = round(seconds * NS) if transfer is Transfer.LINK else 0
        self._move(k, self.names.index(target), req, request, now_ns, Reason.ANSWER, transfer,
                   delay_ns)  # fmt: skip

    def _move(
        self,
        k: int,
        target: int,
        req: SimRequest,
        request: NewRequest,
        now_ns: int,
        reason: Reason,
        transfer: Transfer,
        delay_ns: int = 0,
    ) -> None:
        source = self.engines[k]
        computed = req.num_computed_tokens if transfer is Transfer.LINK else 0
        source.take(req.request_id)
        core = getattr(source.policy, "core", None)
        if isinstance(core, TrackingPolicy):
            core.untrack(req.request_id)  # aborted here: no finished length to learn
        arrive_ns = now_ns + delay_ns
        self.engines[target].adopt(req, arrive_ns, num_computed_tokens=computed)
        self._since_ns[req.request_id] = arrive_ns
        self._moves[req.request_id] += 1
        self.counts.by_reason[reason.value] += 1
        self.counts.by_transfer[transfer.value] += 1
        self._moved(req.request_id, target, request, now_ns)

    def recompute_s(self, num_tokens: int) -> float:
        """The step model's time to prefill ``num_tokens`` alone, in chunks of the step's
        token budget (the recompute a move would pay on an idle target)."""
        total_ns, done = 0, 0
        while done < num_tokens:
            n = min(self.chunk_tokens, num_tokens - done)
            total_ns += self.step_model.step_time_ns(BatchShape(n, 0, done + n, 1))
            done += n
        return total_ns / NS


def _track(engine: Engine, req: SimRequest) -> None:
    """An adopted request, tracked by the target's policy as it stands: its prompt and the
    tokens it generated (the phase they put it in); a policy without tracking is told of an
    arrival."""
    core = getattr(engine.policy, "core", None)
    if isinstance(core, TrackingPolicy):
        generated = [req.stream.token_at(i) for i in range(req.num_output_tokens)]
        core.track(req.request_id, req.stream.prompt_token_ids(0), generated)
    else:
        engine.policy.on_arrival(req)
