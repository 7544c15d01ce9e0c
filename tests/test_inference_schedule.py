"""The pipeline schedule as a pure state machine: closed forms, plans, stopping, and the optimistic steps
laid over it (no model involved)."""

import itertools

import pytest

from inference.cycle.schedule import PipelineSchedule, Steps, Verdict, eos_set
from spd_lightning.geometry import Geometry


def drive(schedule: PipelineSchedule, right) -> PipelineSchedule:
    """Run the schedule with a verifier that accepts when `right(position)` (greedy-style, token = position)."""
    plan = schedule.begin(Verdict.FIRST, 1000, prompt_len=5)
    while plan is not None:
        if plan.judged_position >= 0:
            ok = right(plan.judged_position)
            plan = schedule.begin(Verdict.ACCEPT if ok else Verdict.REJECT, plan.judged_position)
        else:
            plan = schedule.begin(Verdict.NONE, -1)
    return schedule


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("schedule_kind", ["pre_step", "post_step"])
def test_closed_forms(n, schedule_kind):
    geometry = Geometry.build(16, n, schedule=schedule_kind)
    for N in (2, 5, 17):
        oracle = drive(PipelineSchedule(geometry, N), lambda p: True)
        adversary = drive(PipelineSchedule(geometry, N), lambda p: False)
        assert (oracle.N, oracle.K) == (N, N + n - 2)
        assert (adversary.N, adversary.K) == (N, n * (N - 1))
        assert sum(oracle.counters.accepted_by_fill) == N - 1 and sum(oracle.counters.rejected_by_fill) == 0
        assert adversary.counters.rejected_by_fill == [N - 1] + [0] * (n - 1)  # always judged right after a reseed


def test_plans_follow_the_staircase():
    """Stage s runs the token at depth s-1; the PDM view is the geometry's view of the newest position."""
    n = 4
    geometry = Geometry.build(8, n)
    schedule = PipelineSchedule(geometry, 50)
    plan = schedule.begin(Verdict.FIRST, 7, prompt_len=3)
    pattern = iter([True, True, False, True, True, True, True, False] * 10)
    seen_fills = set()
    while plan is not None:
        newest = plan.draft_position - 1
        full_view = geometry.view(newest, plan.fill)
        assert full_view[-plan.fill :] == list(plan.draft_view)
        assert all(d == n for d, _ in full_view[: -plan.fill])
        assert plan.draft_view[0][1] == newest - plan.fill + 1  # everything older is verified
        assert plan.stage_positions[0] == newest
        for s, position in enumerate(plan.stage_positions):
            assert position == -1 or position == newest - s
        seen_fills.add(plan.fill)
        if plan.judged_position >= 0:
            assert plan.stage_positions[n - 1] == plan.judged_position - 1
            plan = schedule.begin(Verdict.ACCEPT if next(pattern) else Verdict.REJECT, 11)
            if plan is not None and plan.rollback_to >= 0:
                assert plan.seed_token == 11 and plan.fill == 1 and not plan.draft_entered
        else:
            plan = schedule.begin(Verdict.NONE, -1)
    assert seen_fills == set(range(1, n + 1))


def test_post_step_reads_one_stage_deeper():
    geometry = Geometry.build(8, 4, schedule="post_step")
    schedule = PipelineSchedule(geometry, 10)
    plan = schedule.begin(Verdict.FIRST, 1, prompt_len=3)
    plan = schedule.begin(Verdict.NONE, -1)
    assert plan.draft_view == ((2, 3), (1, 4))
    assert plan.anchors_during == ((1, 4), (2, 3))  # this cycle's states, sent before the draft


def test_pre_step_anchor_messages_cover_what_the_view_reads():
    geometry = Geometry.build(8, 3)
    schedule = PipelineSchedule(geometry, 10)
    schedule.begin(Verdict.FIRST, 1, prompt_len=3)
    schedule.begin(Verdict.NONE, -1)
    plan = schedule.begin(Verdict.NONE, -1)
    assert plan.anchors_before == ((1, 4), (2, 3))
    plan = schedule.begin(Verdict.REJECT, 9)  # position 4 rejected: only the completed token's states remain needed
    assert plan.anchors_before == ((3, 3),) and plan.rollback_to == 4 and plan.stage_positions == (4, -1, -1)


@pytest.mark.parametrize("eos", [96, [5, 96], (96,)])
def test_eos_ends_the_output(eos):
    geometry = Geometry.build(8, 2)
    schedule = PipelineSchedule(geometry, 100, eos_set(eos))
    schedule.begin(Verdict.FIRST, 3, prompt_len=2)
    schedule.begin(Verdict.NONE, -1)
    assert schedule.begin(Verdict.ACCEPT, 96) is None
    assert schedule.tokens == [3, 96] and schedule.stop_reason == "eos" and schedule.K == 2


def test_first_token_alone():
    geometry = Geometry.build(8, 2)
    eos_first = PipelineSchedule(geometry, 10, eos_set(96))
    assert eos_first.begin(Verdict.FIRST, 96, prompt_len=4) is None and eos_first.K == 0
    one = PipelineSchedule(geometry, 1, eos_set(None))
    assert one.begin(Verdict.FIRST, 5, prompt_len=4) is None and one.N == 1 and one.stop_reason == "max_new_tokens"


def test_inconsistent_verdicts_are_loud():
    geometry = Geometry.build(8, 3)
    schedule = PipelineSchedule(geometry, 10)
    schedule.begin(Verdict.FIRST, 1, prompt_len=2)
    with pytest.raises(RuntimeError, match="no draft was due"):
        schedule.begin(Verdict.ACCEPT, 4)
    with pytest.raises(ValueError, match="n >= 2"):
        PipelineSchedule(Geometry.build(8, 1), 10)


def run_steps(schedule: PipelineSchedule, right, token=lambda position: position) -> list:
    """The physical steps with a verifier that accepts when `right(position)`; each verdict reaches the
    planner as the runner delivers it (awaited by the next step, or at once when final)."""
    steps = Steps(schedule)
    step, made, run = steps.first(1000, prompt_len=5), None, []
    while step is not None:
        run.append(step)
        awaited = made if step.awaits else None
        made = None
        if step.plan.judged_position >= 0 and not (awaited is not None and steps.wasted(*awaited)):
            p = step.plan.judged_position
            made = (Verdict.ACCEPT if right(p) else Verdict.REJECT, token(p))
        step = steps.after(step, awaited, made if step.final else None)
    return run


PATTERNS = ["R", "W", "RW", "WR", "RRW", "WWR", "RWW", "RRRW", "WRWW", "RWRRW"]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["pre_step", "post_step"])
def test_optimistic_steps_keep_the_logical_schedule(n, kind):
    """For any accept/reject pattern: N, K, tokens and counters are the logical schedule's; the physical
    steps are its cycles plus one wasted step per rejection that arrives while the next step runs."""
    geometry = Geometry.build(16, n, schedule=kind)
    for pattern, N in itertools.product(PATTERNS, (2, 7, 20)):
        right = lambda p: pattern[p % len(pattern)] == "R"  # noqa: E731, B023 - used in this iteration
        logical = drive(PipelineSchedule(geometry, N), right)
        schedule = PipelineSchedule(geometry, N)
        run = run_steps(schedule, right)
        assert (schedule.tokens, schedule.K, schedule.counters) == (logical.tokens, logical.K, logical.counters)
        redos = [i for i, step in enumerate(run) if step.redo]
        last = run[-1] if run else None
        final_reject = last is not None and last.final and not right(last.plan.judged_position)
        assert len(run) == logical.K + len(redos)
        assert len(redos) == sum(logical.counters.rejected_by_fill) - final_reject
        for i in redos:  # a redo repeats the wasted step's cycle as the rejection plans it
            wasted, redo = run[i - 1], run[i]
            assert wasted.awaits and wasted.plan.cycle == redo.plan.cycle and wasted.plan.fill == n
            assert redo.plan.fill == 1 and redo.plan.rollback_to >= 0 and not redo.plan.draft_entered
        for previous, step in zip(run, run[1:]):
            assert step.awaits == (previous.plan.judged_position >= 0 and not previous.final and not step.redo)
        assert [s.plan.cycle for s in run if not s.redo] == list(range(1, len(run) - len(redos) + 1))


def test_an_eos_verdict_wastes_the_optimistic_step():
    geometry = Geometry.build(8, 3)
    for right in (lambda p: True, lambda p: p != 9):  # EOS accepted, or EOS as the correction
        schedule = PipelineSchedule(geometry, 50, eos_set(109))
        run = run_steps(schedule, right, token=lambda p: 100 + p)
        assert schedule.tokens[-1] == 109 and schedule.stop_reason == "eos"
        assert run[-1].awaits and run[-1].plan.cycle == schedule.K + 1  # run, then thrown away: K does not count it


def test_speculation_is_the_accepted_plan():
    geometry = Geometry.build(8, 3)
    schedule = PipelineSchedule(geometry, 20)
    plan = schedule.begin(Verdict.FIRST, 1, prompt_len=4)
    while plan.judged_position < 0:
        plan = schedule.begin(Verdict.NONE, -1)
    speculated = schedule.speculate()
    assert schedule.begin(Verdict.ACCEPT, 5) == speculated
    with pytest.raises(RuntimeError, match="nothing is being judged"):
        PipelineSchedule(geometry, 20).speculate()
