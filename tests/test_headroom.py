"""Headroom admission's length model (``meridian.core.headroom``): the expected KV it projects
is the expectation over the finished requests' lengths, computed by brute force here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.core.headroom import (
    GRID_POINTS,
    MIN_SAMPLES,
    Kind,
    LengthModel,
    admissible,
    overflows,
    worth_admitting,
)

BS = 16


def taught(think: list[int], after: list[int], chat: list[int] = ()) -> LengthModel:  # type: ignore[assignment]
    model = LengthModel()
    for t, a in zip(think, after, strict=True):
        model.finished(t, a)
    for n in chat:
        model.finished(None, n)
    return model


def brute(c: int, remaining: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """E[blocks at s] of a request with ``c`` tokens whose remaining length is drawn from
    ``remaining``: it holds (c + s) tokens while it runs, nothing once it ended."""
    alive = (remaining[:, None] > grid[None, :]).mean(axis=0)
    return ((c + grid) / BS + 0.5) * alive


def test_not_ready_until_every_seen_kind_has_enough_samples() -> None:
    model = taught([100] * (MIN_SAMPLES - 1), [20] * (MIN_SAMPLES - 1))
    assert not model.ready
    model.finished(100, 20)
    assert model.ready
    model.finished(None, 50)  # a chat request: now chat needs its own samples
    assert not model.ready
    for _ in range(MIN_SAMPLES - 1):
        model.finished(None, 50)
    assert model.ready


def test_a_fresh_thinking_request_is_projected_over_whole_lengths() -> None:
    rng = np.random.default_rng(1)
    think = rng.integers(50, 2000, 200)
    after = rng.integers(10, 400, 200)
    model = taught(list(think), list(after))
    got = model.expected_blocks([Kind.THINKING], [0], [300], BS)[0]
    want = brute(300, (think + after).astype(float), model.grid)
    np.testing.assert_allclose(got, want)
    assert got.shape == (GRID_POINTS,)


def test_progress_conditions_on_the_requests_that_got_that_far() -> None:
    think = np.array([100] * 50 + [1000] * 50)
    after = np.array([30] * 100)
    model = taught(list(think), list(after))
    # 500 think tokens in: only the 1000-token thinkers got this far; 530 tokens remain.
    got = model.expected_blocks([Kind.THINKING], [500], [800], BS)[0]
    assert got[0] > 0
    alive = model.grid < 530
    # The bucket edge is at or below 500, so the remaining length is at least 530 - (500 -
    # edge): alive through the grid before 530 steps, and ended after 1030.
    assert (got[model.grid < 500] > 0).all() and (got[model.grid >= 1030] == 0).all()
    assert got[alive].max() <= ((800 + 530) / BS + 0.5)
    # An answer 10 tokens in ends within 30 steps.
    ans = model.expected_blocks([Kind.ANSWERING], [10], [1200], BS)[0]
    assert (ans[model.grid >= 30] == 0).all() and ans[0] > 0


def test_a_request_past_every_sample_runs_now_and_ends_like_the_shortest_tail() -> None:
    model = taught([100] * 40, [20] * 40)
    got = model.expected_blocks([Kind.THINKING, Kind.ANSWERING], [5000, 5000], [6000, 6000], BS)
    assert got[0, 0] == pytest.approx(6000 / BS + 0.5)  # it holds its tokens now
    assert (got[1, 1:] == 0).all()  # an answer past every answer ends at once


def test_chat_requests_use_their_own_lengths() -> None:
    model = taught([1000] * 40, [500] * 40, chat=[10] * 40)
    chat = model.expected_blocks([Kind.CHAT], [0], [100], BS)[0]
    thinking = model.expected_blocks([Kind.THINKING], [0], [100], BS)[0]
    assert chat.sum() < thinking.sum() / 10


def test_admissible_stops_at_the_first_request_that_breaks_the_peak() -> None:
    running = np.array([[10.0, 20.0, 5.0]])
    waiting = np.array([[1.0, 5.0, 1.0], [1.0, 5.0, 1.0], [0.0, 9.0, 0.0]])
    blocks = 30  # the peak of running + 2 waiting
    assert admissible(running, waiting, blocks) == 2
    assert admissible(running, waiting, blocks - 2) == 1
    # A small request behind one that does not fit waits too: a prefix of the queue starts.
    assert admissible(running, np.array([[0, 40.0, 0], [0, 0, 0.0]]), blocks) == 0
    # Nothing runs: one request starts even if it alone overflows (progress).
    assert admissible(np.zeros((0, 3)), np.array([[0, 999.0, 0]]), 10) == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3000), min_size=MIN_SAMPLES, max_size=200),
    st.lists(st.integers(1, 800), min_size=MIN_SAMPLES, max_size=200),
    st.lists(st.tuples(st.sampled_from(list(Kind)), st.integers(0, 4000), st.integers(1, 9000)),
             min_size=1, max_size=40),
)  # fmt: skip
def test_projection_bounds(
    think: list[int], after: list[int], reqs: list[tuple[Kind, int, int]]
) -> None:
    n = min(len(think), len(after))
    model = taught(think[:n], after[:n])
    kinds, progress, tokens = zip(*reqs, strict=True)
    blocks = model.expected_blocks(kinds, progress, tokens, BS)
    longest = max(t + a for t, a in zip(think[:n], after[:n], strict=True))
    # Never negative, never more than the request's tokens grown by the longest sample.
    assert (blocks >= 0).all()
    assert (blocks <= (np.array(tokens)[:, None] + longest) / BS + 0.5 + 1e-9).all()
    # Survival never rises with the horizon: blocks/(tokens at s) is non-increasing.
    held = blocks / ((np.array(tokens)[:, None] + model.grid[None, :]) / BS + 0.5)
    assert (np.diff(held, axis=1) <= 1e-12).all()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 900)), min_size=1, max_size=300),
    st.booleans(),
)
def test_every_bucket_is_the_survival_of_the_samples_past_its_edge(
    samples: list[tuple[int, int]], answers: bool
) -> None:
    """The curves are counted for every edge at once; each row must equal the survival of the
    samples that got past the edge, counted one edge at a time (exactly: same counts)."""
    from meridian.core.headroom import _Curves

    progress = np.array([p for p, _ in samples], dtype=np.int64)
    after = np.zeros_like(progress) if answers else np.array([a for _, a in samples])
    grid = np.linspace(0.0, float(max(int((progress + after).max()), 1)), GRID_POINTS)
    curves = _Curves(progress, after, grid)
    for b, edge in enumerate(curves.edges[:-1]):
        beyond = progress > edge
        expected = np.zeros(GRID_POINTS)
        if beyond.any():
            remaining = np.sort(progress[beyond] - edge + after[beyond])
            expected = 1.0 - np.searchsorted(remaining, grid, side="right") / len(remaining)
        assert np.array_equal(curves.surv[b], expected), (b, edge)
        assert curves.empty[b] == (not beyond.any())


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.01, 100.0),  # wait weight
    st.floats(1.0, 1e6),  # overflow tokens
    st.floats(10.0, 1e6),  # prefill tokens per second
    st.floats(0.0, 600.0),  # victim's re-queue delay, s
    st.floats(0.0, 0.999),  # a wait below the crossing, as a fraction of it
    st.floats(1.001, 10.0),  # and one above it
)
def test_the_admission_decision_flips_where_the_costs_cross(
    weight: float, overflow: float, rate: float, requeue: float, below: float, above: float
) -> None:
    """Held below the wait at which its weighted wait equals the preemptions' expected cost
    (recompute at the prefill rate plus the victim's re-queue delay), admitted from it on."""
    cost = overflow / rate + requeue
    crossing = cost / weight
    assert not worth_admitting(crossing * below, weight, overflow, rate, requeue)
    assert worth_admitting(crossing * above, weight, overflow, rate, requeue)
    # At the crossing the costs are equal (up to rounding) and it starts.
    assert worth_admitting(crossing * (1 + 1e-12), weight, overflow, rate, requeue)
    # Dearer preemptions (more overflow, a slower prefill, a longer re-queue) only hold longer:
    # a wait that starts a request against them starts it against the cheaper ones.
    for wait in (crossing * below, crossing * above, crossing * above * 3):
        for dearer in ((overflow * 2, rate), (overflow, rate / 2)):
            if worth_admitting(wait, weight, *dearer, requeue + 1.0):
                assert worth_admitting(wait, weight, overflow, rate, requeue)
    # No weight: waiting costs nothing, and a request that risks a preemption is never started.
    assert not worth_admitting(1e9, 0.0, overflow, rate, requeue)


def test_overflows_measure_the_excess_at_the_peak_and_how_long_it_lasts() -> None:
    grid = np.array([0.0, 10.0, 20.0, 30.0, 40.0])
    running = np.array([[6.0, 6.0, 4.0, 4.0, 0.0]])
    waiting = np.array([[1.0, 2.0, 3.0, 1.0, 0.0], [0.0, 1.0, 2.0, 2.0, 0.0]])
    excess, steps = overflows(running, waiting, 7.0, grid)
    # First alone: 7, 8, 7, 5, 0 -> 1 block over at step 10, back within at 20.
    # Both: 7, 9, 9, 7, 0 -> 2 over at the peak (step 10), over from 10 until 30.
    assert excess.tolist() == [1.0, 2.0]
    assert steps.tolist() == [10.0, 20.0]
    # Within the limit: no excess, no wait; over until the grid's end: the rest of the grid.
    excess, steps = overflows(running, waiting, 20.0, grid)
    assert excess.tolist() == [0.0, 0.0] and steps.tolist() == [0.0, 0.0]
    flat = np.array([[5.0, 5.0, 5.0, 5.0, 5.0]])
    excess, steps = overflows(flat, waiting[:1], 4.0, grid)
    assert excess.tolist() == [4.0] and steps.tolist() == [40.0]
