"""The one staleness module (schemas/staleness.py): admission, "too stale", rollback, lag and histogram.

    .venv/bin/python -m pytest -q tests/unit/test_staleness.py
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbus.schemas import staleness
from rlbus.schemas.config import TrainerConfig
from rlbus.schemas.staleness import NO_VERSION
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup


def _trainer(**kw) -> TrainerConfig:
    return TrainerConfig(**kw)


def test_generated_span_ignores_inserted_tokens():
    # tool output (mask 0) carries version -1; only generated tokens count
    assert staleness.generated_span([3, 3, -1, -1, 5], [1, 1, 0, 0, 1]) == (3, 5)
    assert staleness.generated_span([-1, -1], [0, 0]) == (NO_VERSION, NO_VERSION)
    assert staleness.generated_span([], []) == (NO_VERSION, NO_VERSION)


def test_a_sample_with_no_generated_token_has_no_say():
    # The bug this module fixed: such a sample counted as version 0 in the group's min_version, so the batcher
    # dropped a group that the producer had kept.
    group = TrajectoryGroup(group_id="g", task_id="g", producer_id="p", samples=[
        SampleMeta(key="a", prompt_len=3, response_len=4, reward=1.0, min_version=9, max_version=10),
        SampleMeta(key="b", prompt_len=3, response_len=0, reward=0.0, min_version=NO_VERSION, max_version=NO_VERSION),
    ])
    assert (group.min_version, group.max_version) == (9, 10)
    cfg = _trainer(max_staleness=1)
    assert not staleness.too_stale(10, group.min_version, cfg)
    assert staleness.too_stale(11, group.min_version, cfg)
    empty = TrajectoryGroup(group_id="e", task_id="e", producer_id="p", samples=[group.samples[1]])
    assert (empty.min_version, empty.max_version) == (NO_VERSION, NO_VERSION)
    assert not staleness.too_stale(1000, empty.min_version, _trainer(max_staleness=0))
    assert not staleness.rolled_back(0, empty.max_version)


@pytest.mark.parametrize(("version", "oldest", "max_staleness", "stale"), [
    (5, 5, 0, False),  # max_staleness 0: only the current version is admitted
    (5, 4, 0, True),
    (5, 4, 1, False),
    (5, 3, 1, True),
    (0, 0, 0, False),  # the base model at the start of a run
])
def test_too_stale_under_drop(version, oldest, max_staleness, stale):
    assert staleness.too_stale(version, oldest, _trainer(max_staleness=max_staleness)) is stale


def test_correct_policy_never_drops():
    assert not staleness.too_stale(100, 0, _trainer(max_staleness=0, staleness_policy="correct"))


def test_rolled_back_version():
    # A trainer that resumed from the step-20 checkpoint after reaching 27: tokens of v21..27 have no timeline.
    assert staleness.rolled_back(20, 27)
    assert not staleness.rolled_back(20, 20)
    assert not staleness.rolled_back(20, 19)


def test_allowance_is_areals_rule():
    cfg = _trainer(max_staleness=1, groups_per_step=8)
    assert staleness.allowance(0, released=0, abandoned=0, cfg=cfg) == 16
    assert staleness.allowance(0, released=16, abandoned=0, cfg=cfg) == 0
    assert staleness.allowance(0, released=16, abandoned=3, cfg=cfg) == 3  # abandoned releases free their slots
    assert staleness.allowance(1, released=16, abandoned=0, cfg=cfg) == 8
    assert staleness.allowance(0, released=0, abandoned=0, cfg=_trainer(max_staleness=0, groups_per_step=4)) == 4


@given(version=st.integers(0, 1000), max_staleness=st.integers(0, 8), groups=st.integers(1, 64),
       released=st.integers(0, 100_000))
def test_admitted_work_never_outruns_the_bound(version, max_staleness, groups, released):
    # Whatever the history, releasing exactly the allowance lands on the bound, never past it.
    cfg = _trainer(max_staleness=max_staleness, groups_per_step=groups)
    abandoned = released // 3
    n = staleness.allowance(version, released, abandoned, cfg)
    bound = (version + max_staleness + 1) * groups
    assert (released + max(n, 0)) - abandoned == max(bound, released - abandoned)


def test_lag_and_histogram():
    assert staleness.lag(7, 5) == 2
    assert staleness.lag(7, NO_VERSION) is None
    assert staleness.histogram([0, 2, 2, 0, 0]) == {0: 3, 1: 0, 2: 2}
    assert staleness.histogram([]) == {}


def test_the_lag_sizer_keeps_max_staleness_when_episodes_do_not_wait():
    sizer = staleness.LagSizer(2, 8)
    assert sizer.bound() == 2  # nothing measured yet
    for _ in range(10):
        sizer.group(0.001)  # the quickstart's calculator
        sizer.step(0.3)
    assert sizer.bound() == 2


def test_the_lag_sizer_raises_the_bound_to_hide_the_measured_wait_up_to_its_ceiling():
    sizer = staleness.LagSizer(2, 8)
    for wait in [0.5, 1.0, 1.2, 0.8, 0.9, 1.1, 1.0, 0.7, 1.3, 0.6]:  # tool waits around a second
        sizer.group(wait)
        sizer.step(0.5)
    assert sizer.bound() == 1 + 3  # p90 1.3 s at 0.5 s a step: 3 steps of lag, plus the one in training
    bounds = []
    for _ in range(40):
        sizer.group(30.0)  # a judge that takes half a minute
        sizer.step(0.5)
        bounds.append(sizer.bound())
    assert all(0 <= b - a <= 1 for a, b in zip([4, *bounds], bounds))  # up one a step at most
    assert bounds[-1] == 8  # to the ceiling
    for _ in range(40):
        sizer.group(0.0)  # the judge is fast again: back down at once
    sizer.step(0.5)
    assert sizer.bound() == 2
    assert staleness.LagSizer(2, 2).bound() == 2 and staleness.LagSizer(3, 1).bound() == 3  # fixed bounds


def test_the_lag_sizer_climbs_back_from_a_bound_the_guard_held_not_from_before_it():
    sizer = staleness.LagSizer(2, 8)
    for _ in range(10):
        sizer.group(5.0)
        sizer.step(0.5)
    assert sizer.bound() == 8
    bounds = []
    for i in range(6):
        sizer.group(5.0)
        sizer.step(0.5)
        if i < 3:
            sizer.hold(1)  # tightened for three steps: below the floor, as the guard may go
        bounds.append(sizer.bound())
    assert bounds == [1, 1, 1, 2, 3, 4]  # then up one a step from the floor, never a jump back to 8


def test_the_lag_steps_down_while_its_tokens_mismatch_more_than_half_the_kl_budget():
    sizer = staleness.LagSizer(2, 16, kl_budget=0.1)
    bounds = []
    for i in range(30):
        sizer.group(10.0)  # waits that would need the ceiling
        # the mismatch grows with the lag: 0.01 per version of it
        sizer.step(0.5, 0.01 * sizer.bound())
        bounds.append(sizer.bound())
    assert max(bounds) <= 6 and bounds[-1] in (4, 5, 6)  # settles where the KL is about half the budget (0.05)
    sizer.step(0.5, float("nan"))  # no measure: climbs as before
    assert sizer.bound() == bounds[-1] + 1
