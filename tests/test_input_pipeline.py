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
