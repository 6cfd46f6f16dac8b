"""Several engines on one virtual clock behind one router: ``meridian bench sim --replicas N``.

Each replica is a whole engine (the fast engine model or vLLM's own scheduler,
:mod:`meridian.sim.engine`, :mod:`meridian.sim.vllm_engine`) with its own KV cache and its own
scheduling (Meridian's or a baseline's); the engines are driven event by event through a narrow
interface (``add``, ``next_event_ns``, ``advance``) on one integer-nanosecond clock. The router
(:mod:`meridian.sim.routers`) sees what it sees under Ray Serve:

- every replica's stats as taken at the last refresh (every ``stats_period_s``, all replicas at
  once: Ray's controller polls them in one loop), built by the same code as the Ray replica's
  (:class:`~meridian.core.replica_stats.ReplicaStatsRecorder` over the replica's Meridian policy);
- its own in-flight requests: a request counts from its placement until its last token.

Routing as Ray Serve 2.60 does it (``ray/serve/_private/request_router/request_router.py``):
requests wait in arrival order for one of at most ``min(50, 2 x replicas)`` routing tasks; a
task asks the router and, when it holds the request, asks again after a backoff of 25 ms doubling
to 500 ms (Serve's immediate second try sees the same state and is skipped here); once the
request is placed, the task takes the next one at once. A router that never holds places every
request at its arrival.

At one instant: the stats refresh, then arrivals, then retries, then the engines' events in
replica order (a completion reaches the router when its engine handles it), then, with a
migrator (:mod:`meridian.sim.migration`), the moves it decides on the preemptions and
``</think>`` tokens the engines reported (long waits it looks for at each stats refresh).
Deterministic: the same streams, seed and router give the same run.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meridian.core.policy import MeridianPolicy
from meridian.core.replica_stats import ReplicaStatsRecorder
from meridian.core.routing import NewRequest, ReplicaStats
from meridian.core.types import Phase
from meridian.errors import MeridianError
from meridian.sim.engine import Engine, SimulationError
from meridian.sim.migration import MigrationCounts, Migrator
from meridian.sim.records import RunCounters, SimResult, TimeSample
from meridian.sim.routers import ClusterRouter
from meridian.sim.streams import SIM_FORMAT, Stream

__all__ = ["Cluster", "ClusterRun", "ModelReplica", "Replica", "VllmReplica"]

NS = 1_000_000_000
# Ray Serve's routing retries (RAY_SERVE_ROUTER_RETRY_*) and its cap on routing tasks.
BACKOFF_INITIAL_NS = 25_000_000
BACKOFF_MAX_NS = 500_000_000
MAX_ROUTING_TASKS = 50
# The cluster's own time series: one sample of every replica's load a second.
SAMPLE_PERIOD_NS = NS


class Replica(Protocol):
    """What the cluster needs of one engine."""

    def start(self) -> None: ...

    def add(self, stream: Stream, at_ns: int) -> None: ...

    def next_event_ns(self) -> int | None: ...

    def advance(self, until_ns: int) -> None: ...

    def stats(self, now_ns: int, *, phases: bool, projection: bool) -> ReplicaStats:
        """The replica's stats now; ``phases``: count answer streams; ``projection``: with the
        headroom projection (where its Meridian policy has one)."""

    def result(self) -> SimResult: ...


def _counts(
    now_ns: int, running: int, waiting: int, usable: int, used: int, answering: int
) -> ReplicaStats:
    return ReplicaStats(
        time_s=now_ns / NS,
        num_running=running,
        num_waiting=waiting,
        num_answering=answering,
        num_thinking=running - answering,
        num_kv_blocks=usable,
        num_kv_blocks_used=used,
    )


class _EngineReplica:
    """The engine's own event-by-event interface, as :class:`Replica` names it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._recorder = ReplicaStatsRecorder()

    def start(self) -> None:
        self.engine.start()

    def add(self, stream: Stream, at_ns: int) -> None:
        self.engine.add(stream, at_ns)

    def next_event_ns(self) -> int | None:
        result: int | None = self.engine.next_event_ns()
        return result

    def advance(self, until_ns: int) -> None:
        self.engine.advance(until_ns)

    def result(self) -> SimResult:
        result: SimResult = self.engine.finish()
        return result


class ModelReplica(_EngineReplica):
    """A fast-engine replica (:class:`~meridian.sim.engine.Engine`)."""

    def __init__(self, engine: Engine, on_finish: Callable[[str], None]) -> None:
        super().__init__(engine)
        engine.on_finish = lambda req: on_finish(req.request_id)

    def stats(self, now_ns: int, *, phases: bool, projection: bool) -> ReplicaStats:
        engine = self.engine
        pool = engine.pool
        usable, used = pool.num_usable_blocks, pool.num_usable_blocks - pool.num_free_blocks
        core = getattr(engine.policy, "core", None)
        if projection and isinstance(core, MeridianPolicy):
            return self._recorder.record(
                core,
                engine.running,
                engine.queued(),
                num_kv_blocks=usable,
                num_kv_blocks_used=used,
                num_steps=engine.step,
                now=now_ns / NS,
            )
        answering = sum(r.phase is Phase.OUTPUT for r in engine.running) if phases else 0
        waiting = len(engine.queued()) if engine.policy.uses_priority else len(engine.waiting)
        return _counts(now_ns, len(engine.running), waiting, usable, used, answering)


class VllmReplica(_EngineReplica):
    """A replica on vLLM's own scheduler (:class:`~meridian.sim.vllm_engine.VllmEngine`)."""

    def __init__(self, engine: Any, on_finish: Callable[[str], None]) -> None:
        super().__init__(engine)
        engine.on_finish = on_finish

    def stats(self, now_ns: int, *, phases: bool, projection: bool) -> ReplicaStats:
        scheduler = self.engine.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1
        used = usable - pool.get_num_free_blocks()
        policy = getattr(scheduler, "meridian_policy", None)
        if projection and isinstance(policy, MeridianPolicy):
            return self._recorder.record(
                policy,
                scheduler.running,
                list(scheduler.waiting),
                num_kv_blocks=usable,
                num_kv_blocks_used=used,
                num_steps=scheduler.current_step,
                now=now_ns / NS,
            )
        answering = 0
        if phases:
            answering = sum(
                self.engine.phase(r.request_id) is Phase.OUTPUT for r in scheduler.running
            )
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        return _counts(now_ns, running, waiting, usable, used, answering)


@dataclass(slots=True, eq=False)
class _Held:
    """A request not placed yet: waiting for a routing task, or between two attempts."""

    stream: Stream
    request: NewRequest
    attempts: int = 0


@dataclass(slots=True)
class ClusterRun:
    """A cluster run: the merged result (every replica's requests and counters), each replica's
    own, the router's holds (requests held at least once; how long each waited) and, with a
    migrator, its moves."""

    result: SimResult
    replicas: list[SimResult]
    num_held: int
    hold_s: list[float] = field(default_factory=list)
    migrations: MigrationCounts | None = None


def new_request(stream: Stream) -> NewRequest:
    """What a router knows of a simulated request: its initial phase, by the rule the replica
    applies to its prompt's tail, its prompt length and its own bound."""
    phase = SIM_FORMAT.initial_phase(stream.prompt_tail())
    return NewRequest(phase, stream.spec.num_prompt_tokens, stream.max_tokens)


class Cluster:
    """``replicas`` behind ``router`` on one clock (module docstring); :meth:`run` once."""

    def __init__(
        self,
        make_replica: Callable[[Callable[[str], None]], Replica],
        num_replicas: int,
        router: ClusterRouter,
        *,
        name: str,
        on_progress: Callable[[int], None] | None = None,
        migrator: Migrator | None = None,
    ) -> None:
        self.router = router
        self.name = name
        self._on_progress = on_progress
        self._placed: dict[str, int] = {}
        self._num_finished = 0
        self.replicas = [make_replica(self._finished) for _ in range(num_replicas)]
        self._max_tasks = min(MAX_ROUTING_TASKS, 2 * num_replicas)
        self._samples: list[TimeSample] = []
        self.migrator = migrator
        # A router that reads the engines themselves (the clairvoyant reference) is given them.
        attach = getattr(router, "attach", None)
        if migrator is not None or attach is not None:
            engines = [r.engine for r in self.replicas if isinstance(r, ModelReplica)]
            if len(engines) != num_replicas:
                raise MeridianError(f"router {router.name}: needs the fast engine (--engine model)")
            if attach is not None:
                attach(engines)
            if migrator is not None:
                names = [f"r{i:03d}" for i in range(num_replicas)]
                migrator.attach(engines, names, self._placed.__getitem__, self._moved)
        self._describe: Callable[[Stream], NewRequest] = getattr(router, "describe", new_request)

    def _moved(self, request_id: str, target: int, request: NewRequest, now_ns: int) -> None:
        self._placed[request_id] = target
        self.router.routed(target, request_id, request, now_ns / NS)

    def _finished(self, request_id: str) -> None:
        self.router.completed(self._placed[request_id], request_id)
        self._num_finished += 1
        if self._on_progress is not None:
            self._on_progress(self._num_finished)

    def run(self, streams: Sequence[Stream]) -> ClusterRun:
        """Serve every stream to completion."""
        for replica in self.replicas:
            replica.start()
        arrivals = sorted(streams, key=lambda s: (s.spec.arrival_ns, s.request_id))
        router, replicas = self.router, self.replicas
        period = router.stats_period_s
        refresh_ns = max(1, round(period * NS)) if period else None
        next_refresh: int | None = 0 if refresh_ns else None
        next_sample = 0
        pending: deque[_Held] = deque()
        retries: list[tuple[int, int, _Held]] = []
        seq = itertools.count()
        active = 0
        hold_s: list[float] = []
        i = 0

        def attempt(held: _Held, now: int) -> bool:
            """Ask the router; place the request, or schedule its next attempt."""
            stream = held.stream
            waited = (now - stream.spec.arrival_ns) / NS
            choice = router.choose(held.request, now / NS, waited)
            if choice is None:
                delay = min(BACKOFF_INITIAL_NS << min(held.attempts, 16), BACKOFF_MAX_NS)
                held.attempts += 1
                heapq.heappush(retries, (now + delay, next(seq), held))
                return False
            if held.attempts:
                hold_s.append(waited)
            self._placed[stream.request_id] = choice
            router.routed(choice, stream.request_id, held.request, now / NS)
            replicas[choice].add(stream, now)
            return True

        while True:
            engine_times = [t for r in replicas if (t := r.next_event_ns()) is not None]
            busy = i < len(arrivals) or pending or retries or engine_times
            if not busy:
                break
            candidates = [*engine_times, next_sample]
            if i < len(arrivals):
                candidates.append(arrivals[i].spec.arrival_ns)
            if retries:
                candidates.append(retries[0][0])
            if next_refresh is not None:
                candidates.append(next_refresh)
            now = min(candidates)
            if next_refresh is not None and now == next_refresh:
                phases, projection = True, router.needs_projection
                for k, replica in enumerate(replicas):
                    router.observe(k, replica.stats(now, phases=phases, projection=projection))
                next_refresh += refresh_ns or 0
                if self.migrator is not None:
                    self.migrator.scan_waits(now)
            if now == next_sample:
                self._sample(now, len(pending) + len(retries))
                next_sample += SAMPLE_PERIOD_NS
            while i < len(arrivals) and arrivals[i].spec.arrival_ns == now:
                pending.append(_Held(arrivals[i], self._describe(arrivals[i])))
                i += 1
            ready: list[_Held] = []
            while retries and retries[0][0] == now:
                ready.append(heapq.heappop(retries)[2])
            for held in ready:
                if attempt(held, now):
                    active -= 1
            while pending and active < self._max_tasks:
                held = pending.popleft()
                if not attempt(held, now):
                    active += 1
            for replica in replicas:
                replica.advance(now)
            if self.migrator is not None:
                self.migrator.act(now)
        results = [r.result() for r in replicas]
        return ClusterRun(
            result=self._merge(streams, results),
            replicas=results,
            num_held=len(hold_s),
            hold_s=hold_s,
            migrations=None if self.migrator is None else self.migrator.counts,
        )

    def _sample(self, now: int, num_held: int) -> None:
        loads = [r.stats(now, phases=False, projection=False) for r in self.replicas]
        self._samples.append(
            TimeSample(
                time_ns=now,
                num_kv_blocks_used=sum(s.num_kv_blocks_used for s in loads),
                num_kv_blocks_think=0,
                num_running=sum(s.num_running for s in loads),
                num_waiting=sum(s.num_waiting for s in loads) + num_held,
                queue_output=0,
                queue_think=0,
            )
        )

    def _merge(self, streams: Sequence[Stream], results: list[SimResult]) -> SimResult:
        """One result for the cluster: every request's record, the counters summed."""
        by_id = {r.request_id: r for result in results for r in result.records}
        if len(by_id) != len(streams):
            raise SimulationError(f"{len(streams)} requests in, {len(by_id)} records out")
        counters = RunCounters()
        for result in results:
            c = result.counters
            counters.num_steps += c.num_steps
            counters.num_scheduled_rows += c.num_scheduled_rows
            counters.num_scheduled_tokens += c.num_scheduled_tokens
            counters.num_recomputed_tokens += c.num_recomputed_tokens
            counters.num_offload_stored_blocks += c.num_offload_stored_blocks
            counters.num_offload_loaded_blocks += c.num_offload_loaded_blocks
            for phase, n in c.preemptions_by_phase.items():
                counters.preemptions_by_phase[phase] = (
                    counters.preemptions_by_phase.get(phase, 0) + n
                )
        return SimResult(
            policy=self.name,
            engine=results[0].engine,
            num_kv_blocks=sum(r.num_kv_blocks for r in results),
            records=[by_id[s.request_id] for s in streams],
            samples=self._samples,
            counters=counters,
            end_ns=max(r.end_ns for r in results),
        )
