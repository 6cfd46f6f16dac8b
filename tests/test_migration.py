"""Moving requests between replicas (``meridian.core.migration``, ``meridian.sim.migration``):
a re-placed request recomputes its prompt and generated tokens on the target before it decodes
again, and its counts are right; a request moved with its KV pays the link's time and no
recompute; the decisions move only what the rules say, where there is room; the split places
by kind and moves every ``</think>`` to its answer-first replicas; the clairvoyant reference is
at least as good as Meridian's router on a small contended case."""

from __future__ import annotations

import dataclasses

import pytest

from meridian.config import MeridianConfig
from meridian.core.migration import MigrationConfig, MigrationPolicy, Reason, Transfer
from meridian.core.routing import NewRequest, ReplicaStats, RoutingPolicy
from meridian.core.types import Phase
from meridian.errors import ConfigError
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.policies import make_sim_policy, parse_policy
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.streams import FORCING_OFF, Stream, build_streams
from test_cluster_sim import SPEC, burst, run
from test_sim_engine import LinearStepTime

PROMPT, THINK, ANSWER = 100, 200, 50
BS = 16


def engine(policy: str = "meridian") -> Engine:
    cfg = EngineConfig(num_kv_blocks=400, max_num_seqs=16, max_num_batched_tokens=512)
    made = Engine(cfg, LinearStepTime(), make_sim_policy(parse_policy(policy), MeridianConfig(), 1))
    made.start()
    return made


def one_request() -> tuple[Engine, Stream]:
    spec = RequestSpec("q", 0, PROMPT, THINK, ANSWER, RequestKind.REASONING)
    (stream,) = build_streams([spec], FORCING_OFF, MeridianConfig())
    source = engine()
    source.add(stream, 0)
    return source, stream


def run_until(e: Engine, done: object) -> None:
    while (at := e.next_event_ns()) is not None and not done():  # type: ignore[operator]
        e.advance(at)


@pytest.mark.parametrize("policy", ["meridian", "vllm-fcfs"])
def test_a_replaced_request_recomputes_its_tokens_before_it_decodes(policy: str) -> None:
    source, stream = one_request()
    req = source._requests[0]
    run_until(source, lambda: req.num_output_tokens >= 20)
    generated, computed = req.num_output_tokens, req.num_computed_tokens
    assert computed == PROMPT + generated - 1  # the last token sampled, not yet computed
    moved = source.take("q")
    assert moved is req and source.pool.num_free_blocks == source.pool.num_usable_blocks
    assert not source.running and not source.queued()
    target = engine(policy)
    now = source.now_ns
    target.adopt(moved, now)
    # The target's first step prefills every token so far; no token comes out before it ends.
    target.advance(now)
    if policy == "meridian":  # tracked as vLLM would hand it over: the whole prompt
        assert target.policy.core.tracker.states["q"].num_prompt_tokens == PROMPT  # type: ignore[attr-defined]
    assert target.running == [moved] and target.counters.num_scheduled_tokens == PROMPT + generated
    assert moved.num_output_tokens == generated
    run_until(target, lambda: False)
    result = target.finish()
    (record,) = result.records
    assert record.finish_ns is not None and not source.finish().records
    assert record.num_think_tokens + 1 + record.num_answer_tokens == stream.num_output_tokens
    # What the source computed is computed again, and nothing else.
    assert record.num_recomputed_tokens == computed


def test_a_request_moved_with_its_kv_pays_the_link_and_recomputes_nothing() -> None:
    source, _ = one_request()
    req = source._requests[0]
    run_until(source, lambda: req.num_output_tokens > THINK)  # its </think> is out
    computed = req.num_computed_tokens
    kv_bytes = computed * 144 * 1024  # Qwen3-8B's KV bytes a token
    policy = MigrationPolicy(RoutingPolicy())
    transfer, seconds = policy.transfer(kv_bytes, recompute_s=1.0)
    assert transfer is Transfer.LINK and seconds == pytest.approx(kv_bytes / 25e9)
    now = source.now_ns
    source.take("q")
    target = engine()
    delay_ns = round(seconds * 1e9)
    target.adopt(req, now + delay_ns, num_computed_tokens=computed)
    answered = req.record.num_answer_tokens
    run_until(target, lambda: req.record.num_answer_tokens > answered)
    # The next answer token comes one decode step after the KV arrived, not before.
    assert req.record.answer_token_ns[-1] >= now + delay_ns
    run_until(target, lambda: False)
    assert req.record.num_recomputed_tokens == 0
    assert req.record.finish_ns is not None
    # Recompute wins where the link is slower than the prefill.
    slow = MigrationPolicy(RoutingPolicy(), MigrationConfig(link_bytes_per_s=1e6))
    assert slow.transfer(kv_bytes, recompute_s=0.2) == (Transfer.RECOMPUTE, 0.2)


def counts(time_s: float, used: int, waiting: int = 0) -> ReplicaStats:
    return ReplicaStats(
        time_s=time_s,
        num_running=4,
        num_waiting=waiting,
        num_answering=2,
        num_thinking=2,
        num_kv_blocks=1000,
        num_kv_blocks_used=used,
        block_size=BS,
    )


def test_decisions_move_only_what_the_rules_say_to_where_there_is_room() -> None:
    routing = RoutingPolicy()
    policy = MigrationPolicy(routing, MigrationConfig(max_wait_s=5.0, max_moves=1))
    routing.observe("a", counts(0.0, 990, waiting=3))  # full, a queue
    routing.observe("b", counts(0.0, 700))  # 300 free
    routing.observe("c", counts(0.0, 500))  # 500 free: the most room
    names = ["a", "b", "c"]
    request = NewRequest(Phase.THINK, 160 * BS)  # 160 blocks
    replace = policy.replace
    assert replace("a", names, request, 1.0, preempted=True, waited_s=0.0, num_moves=0) == (
        Reason.PREEMPTED,
        "c",
    )
    assert replace("a", names, request, 1.0, preempted=False, waited_s=6.0, num_moves=0) == (
        Reason.WAITED,
        "c",
    )
    assert replace("a", names, request, 1.0, preempted=False, waited_s=4.0, num_moves=0) is None
    assert replace("a", names, request, 1.0, preempted=True, waited_s=0.0, num_moves=1) is None
    # Too big for any other replica: it stays.
    huge = NewRequest(Phase.THINK, 600 * BS)
    assert replace("a", names, huge, 1.0, preempted=True, waited_s=0.0, num_moves=0) is None
    # Stale stats give no room.
    assert replace("a", names, request, 20.0, preempted=True, waited_s=0.0, num_moves=0) is None
    # An answer stream moves from a replica under pressure only.
    answer = NewRequest(Phase.OUTPUT, 160 * BS, 100)
    assert policy.move_answer("a", names, answer, 1.0, num_moves=0) == "c"
    assert policy.move_answer("c", names, answer, 1.0, num_moves=0) is None
    routing.failed("c", 1.0)
    assert policy.move_answer("a", names, answer, 1.0, num_moves=0) == "b"
    with pytest.raises(ConfigError, match=r"^migration\.link_bytes_per_s must be a positive"):
        MigrationConfig(link_bytes_per_s=0)


def test_the_split_places_by_kind_and_moves_answers_to_the_answer_first_replicas() -> None:
    routing = RoutingPolicy()
    policy = MigrationPolicy(routing, MigrationConfig(max_moves=1, answer_share=0.125))
    unsplit = MigrationPolicy(routing, MigrationConfig(max_moves=1))
    # The last eighth of the replicas, rounded, at least one and never all.
    sizes = {n: len(policy.answer_pool([f"r{i}" for i in range(n)])) for n in (1, 2, 4, 8, 16, 24)}
    assert sizes == {1: 0, 2: 1, 4: 1, 8: 1, 16: 2, 24: 3}
    quarter = MigrationPolicy(routing, MigrationConfig(answer_share=0.25))
    assert quarter.answer_pool(["a", "b", "c", "d"]) == ["d"]
    names = ["a", "b", "c", "d", "e", "f", "g", "h"]
    thinking, chat = NewRequest(Phase.THINK, 100), NewRequest(Phase.OUTPUT, 100)
    assert policy.placement(names, thinking) == names[:7]
    assert policy.placement(names, chat) == ["h"]
    assert policy.placement(["a"], chat) == ["a"]  # one replica: no split
    assert unsplit.answer_pool(names) == () and unsplit.placement(names, chat) == names
    for name, used in zip(names, (500, 990, 100, 100, 100, 100, 100, 600), strict=True):
        routing.observe(name, counts(0.0, used))
    answer = NewRequest(Phase.OUTPUT, 160 * BS, 100)
    # Every </think> on a thinking replica moves to the answer-first one, pressure or not.
    assert policy.move_answer("a", names, answer, 1.0, num_moves=0) == "h"
    assert policy.move_answer("h", names, answer, 1.0, num_moves=0) is None  # already there
    assert policy.move_answer("a", names, answer, 1.0, num_moves=1) is None  # moved enough
    huge = NewRequest(Phase.OUTPUT, 500 * BS, 100)  # h has 400 blocks free: no room
    assert policy.move_answer("a", names, huge, 1.0, num_moves=0) is None
    # Moved under pressure alone, it would stay on a (room, no queue); from b (full) it would go
    # to the replica with the most room, a thinking one.
    assert unsplit.move_answer("a", names, answer, 1.0, num_moves=0) is None
    assert unsplit.move_answer("b", names, answer, 1.0, num_moves=0) == "c"
    with pytest.raises(ConfigError, match=r"^migration\.answer_share must be between 0 and 1"):
        MigrationConfig(answer_share=1.0)


@pytest.mark.parametrize("router", ["meridian-move", "meridian-split"])
def test_migrating_routers_serve_every_request_and_count_their_moves(router: str) -> None:
    spec = dataclasses.replace(SPEC, policies=["meridian"])
    requests = burst(1400, seed=3)
    moved = run(spec, 4, router, "meridian", requests, num_kv_blocks=2100)
    assert all(r.finished for r in moved.result.records)
    assert moved.migrations is not None
    num_moved = moved.migrations.by_reason["answer"]
    assert num_moved == sum(moved.migrations.by_transfer.values()) > 0
    assert moved.migrations.transfer_s > 0.0
    # Each request is recorded once, on the replica it finished on.
    assert sum(len(r.records) for r in moved.replicas) == len(requests)
    if router == "meridian-split":
        # Chat requests are placed on the answer-first replica only; reasoning requests reach
        # it only by moving at </think>, and every one that moved finished there.
        kinds = {spec.request_id: spec.kind for spec in requests}
        *thinking, answering = moved.replicas
        assert all(
            kinds[r.request_id] is RequestKind.REASONING for t in thinking for r in t.records
        )
        there = [r for r in answering.records if kinds[r.request_id] is RequestKind.REASONING]
        assert len(there) == num_moved


def test_clairvoyant_placement_is_at_least_as_good_on_a_contended_burst() -> None:
    spec = dataclasses.replace(SPEC, policies=["vllm-fcfs"])
    requests = burst(1400, seed=3)
    ranked = run(spec, 2, "meridian", "vllm-fcfs", requests, num_kv_blocks=2100).result
    knowing = run(spec, 2, "clairvoyant", "vllm-fcfs", requests, num_kv_blocks=2100).result
    assert all(r.finished for r in knowing.records)

    def preemptions(result: object) -> int:
        return sum(result.counters.preemptions_by_phase.values())  # type: ignore[attr-defined]

    assert 0 < preemptions(knowing) <= preemptions(ranked)
    assert knowing.counters.num_recomputed_tokens <= ranked.counters.num_recomputed_tokens
