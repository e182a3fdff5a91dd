"""The run's input pipeline (``embedding.input_pipeline``): lanes keep upcoming batches in step order, prepare them
on their worker (or inline), drop only what their form says may go, and hand a preparation's error to the step
that takes it. Checked against a plain-Python model of the queue rules."""

from __future__ import annotations

from collections import deque

import pytest

from embedscale.embedding.input_pipeline import InputPipeline
from embedscale.errors import InputError


def _model(pushes: list[int], max_ahead: int, droppable) -> list[int]:
    """The queue rule by hand: before a push, while full, drop the head if ``droppable(head)``."""
    q: deque[int] = deque()
    for x in pushes:
        while len(q) >= max_ahead and droppable(x=q[0]):
            q.popleft()
        q.append(x)
    return list(q)


@pytest.mark.parametrize("background", [True, False])
def test_lane_keeps_step_order_and_drops_what_its_form_allows(background):
    pipe = InputPipeline("t")
    keep_odd = pipe.lane("odd-stays", 3, lambda a: a.features % 2 == 0)
    drop_all = pipe.lane("any-goes", 2)
    pushes = [0, 2, 1, 4, 3, 6, 8, 5]
    for x in pushes:
        keep_odd.push(x, lambda v: v * 10, background=background)
        drop_all.push(x, lambda v: -v, background=background)
    assert pipe.pending() == len(keep_odd) + len(drop_all)
    got_odd = [keep_odd.pop() for _ in range(len(keep_odd))]
    got_all = [drop_all.pop() for _ in range(len(drop_all))]
    assert [a.features for a in got_odd] == _model(pushes, 3, lambda x: x % 2 == 0)
    assert [a.features for a in got_all] == _model(pushes, 2, lambda x: True)
    assert [a.value for a in got_odd] == [10 * a.features for a in got_odd]  # each batch its own preparation
    assert [a.value for a in got_all] == [-a.features for a in got_all]
    assert keep_odd.head() is None and pipe.pending() == 0
    pipe.close()


def test_lane_hands_a_preparation_error_to_the_step_that_takes_it():
    pipe = InputPipeline("t")
    lane = pipe.lane("bad", 4)

    def check(v):
        if v < 0:
            raise InputError(f"row id {v} outside the table")
        return v

    lane.push(1, check)
    lane.push(-7, check)
    assert lane.pop().value == 1
    bad = lane.pop()
    with pytest.raises(InputError, match="row id -7"):
        bad.value
    pipe.close()


def test_a_fed_lane_hands_the_producers_batches_in_order_then_its_end_or_error():
    """The host lane's rules: a producer thread puts batches, the trainer waits for the head; after ``end`` an
    empty lane says ``None``; the producer's error is raised to the waiter; ``close`` opens the next pass."""
    import threading

    pipe = InputPipeline("t")
    lane = pipe.lane("host", 3)
    made = list(range(5))

    def produce():
        for x in made:
            lane.put(x, x * 10)
        lane.end()

    t = threading.Thread(target=produce)
    t.start()
    seen = []
    while (head := lane.wait_head(60)) is not None:
        seen.append((head.features, head.value))
        lane.pop()
    t.join()
    assert seen == [(x, 10 * x) for x in made]
    lane.close()  # the next pass: not ended, nothing queued
    with pytest.raises(InputError, match="the server stopped"):
        lane.wait_head(60, lambda: InputError("the server stopped"))
    lane.leave()
    assert pipe.find("host") is None and pipe.lanes == []


@pytest.mark.parametrize("every", [3, 4])
def test_held_back_keeps_the_batches_around_a_replan_check_and_managed_reads(every):
    """A batch a re-plan may migrate before (``migrates``, the drift monitor's word) is not handed over; managed
    tables also keep the batch of a step right after an evaluation or a checkpoint."""
    from embedscale.embedding.input_pipeline import held_back

    steps = range(1, 20)
    assert all(held_back(s, migrates=True) for s in steps)
    assert [s for s in steps if held_back(s, eval_every=every, checkpoint_every=5)] == []  # (nothing to keep)
    assert [s for s in steps if held_back(s, managed=True, eval_every=every, checkpoint_every=5)] == \
        [s for s in steps if s % every == 0 or s % 5 == 0]
    assert not any(held_back(s) for s in steps)


def test_a_head_its_worker_has_not_started_is_prepared_by_the_thread_that_takes_it():
    """The worker busy with a batch that waits: the next batch's preparation, not started, runs on the taking thread
    (its result the work's own, by hand: the square), and the worker never runs it."""
    import threading

    pipe = InputPipeline("t")
    lane = pipe.lane("l", 4)
    release, ran_on = threading.Event(), {}

    def work(x):
        if x == 0:
            release.wait(30)
        ran_on[x] = threading.get_ident()
        return x * x

    lane.push(0, work)
    lane.push(3, work)
    lane._queue.popleft()  # the blocked batch leaves (its step did not run): the one behind it is the head
    assert lane.head().value == 9 and ran_on[3] == threading.get_ident()
    release.set()
    lane.close()
    assert ran_on[0] != threading.get_ident()
