"""The input pipeline: upcoming batches' ``input_dist`` run ahead of their steps, on worker threads.

OPER 5.1 pipelined with the previous step, as TorchRec's ``TrainPipelineSparseDist`` runs the next batch's input
distribution during the current step. A run owns one :class:`InputPipeline`; every form whose lookup prepares a
batch ahead opens a :class:`Lane` on it: a sharded module (``ShardedEmbedding.prefetch``: the batch's ids checked
and decoded, its remote rows deduplicated by owner) and the TT tables of a ``MixedEmbedding`` (their ids renamed,
selected per table, and each table's reuse plan). ``Lane.push(features, work)`` queues a batch, in step order, and
runs ``work(features)`` on the lane's worker thread; the form's lookup takes the result when it looks that batch up
(``data.batch.same_batch`` tells it is the one prepared). A module used without a run makes a pipeline of its own.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Ahead:
    """A batch queued on a lane and its prepared input, computed on the lane's worker until first needed."""

    __slots__ = ("features", "_future", "_value")

    def __init__(self, features, future: Future | None = None, value: Any = None):
        self.features, self._future, self._value = features, future, value

    @property
    def value(self) -> Any:
        """The prepared input (joins the worker; re-raises its error, e.g. an ``InputError``)."""
        if self._future is not None:
            self._value = self._future.result()
            self._future = None
        return self._value

    @property
    def ready(self) -> bool:
        """Whether :attr:`value` is there without waiting for the worker."""
        return self._future is None or self._future.done()

    @property
    def joined(self) -> bool:
        """Whether the worker's result was taken (the form may have advanced it since)."""
        return self._future is None


class Lane:
    """One form's queue of upcoming batches, in step order, with its worker thread.

    ``max_ahead``: batches kept at most; when full, a push first drops the oldest batches ``droppable`` says may go
    (never consumed: a step that did not run)."""

    def __init__(self, pipeline: InputPipeline, name: str, max_ahead: int, droppable: Callable[[Ahead], bool]):
        self.pipeline, self.name, self.max_ahead, self.droppable = pipeline, name, max_ahead, droppable
        self._queue: deque[Ahead] = deque()
        self._pool: ThreadPoolExecutor | None = None

    def push(self, features, work: Callable[[Any], Any], background: bool = True) -> None:
        """Queue ``features`` and prepare them with ``work`` (on the worker, or now without ``background``)."""
        while len(self._queue) >= self.max_ahead and self.droppable(self._queue[0]):
            self._queue.popleft()
        if not background:
            self._queue.append(Ahead(features, value=work(features)))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.pipeline.name}-{self.name}")
        self._queue.append(Ahead(features, future=self._pool.submit(work, features)))

    def head(self) -> Ahead | None:
        """The oldest queued batch, or ``None``."""
        return self._queue[0] if self._queue else None

    def pop(self) -> Ahead:
        """Remove and return the oldest queued batch."""
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Forget the queued batches and stop the worker (after the running preparation)."""
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class InputPipeline:
    """The lanes of every form that prepares batches ahead (see the module docstring)."""

    def __init__(self, name: str = "input"):
        self.name = name
        self.lanes: list[Lane] = []

    def lane(self, name: str, max_ahead: int, droppable: Callable[[Ahead], bool] = lambda a: True) -> Lane:
        """A new lane for one form."""
        lane = Lane(self, name, max_ahead, droppable)
        self.lanes.append(lane)
        return lane

    def pending(self) -> int:
        """Batches queued on every lane."""
        return sum(len(lane) for lane in self.lanes)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
