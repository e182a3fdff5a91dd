"""The input pipeline: upcoming batches' ``input_dist`` run ahead of their steps, on worker threads.

OPER 5.1 pipelined with the previous step, as TorchRec's ``TrainPipelineSparseDist`` runs the next batch's input
distribution during the current step. A run owns one :class:`InputPipeline` and hands it every upcoming training
batch (:meth:`InputPipeline.prefetch`, before the step before the batch's own); the pipeline gives the batch's
features to its *entry* form, and every form whose lookup prepares a batch ahead opens a :class:`Lane` on it:

* ``sharded``: a sharded module (``ShardedEmbedding.prefetch``): the batch's ids checked and decoded; in the
  retrieve design its remote rows deduplicated by owner (their counts and requests then ride the step before's
  exchanges), in the send design its partial bags and the messages to their owners (their counts then ride the
  step before's pooled exchange, the messages its gradient exchange);
* ``tt``: the TT tables of a ``MixedEmbedding``: their ids renamed, selected per table, each table's reuse plan;
* ``host``: the host parameter server's lookahead (``pipeline.loop``): the server takes each batch from the loader
  before it waits for older gradients and *puts* it here with its device modules' selection of it (a lane fed by
  another thread); the run's loop takes the next step's batch from this lane (:meth:`Lane.wait_head`) and the
  pipeline hands the entry form the selection the server made (the objects its lookup will get).

``Lane.push(features, work)`` queues a batch, in step order, and runs ``work(features)`` on the lane's worker
thread; the form's lookup takes the result when it looks that batch up (``data.batch.same_batch`` tells it is the
one prepared). A module used without a run makes a pipeline of its own. Results are the same bits with or without
the pipeline: only the place and time of the preparation change.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from embedscale.errors import EmbedscaleError


class Ahead:
    """A batch queued on a lane and its prepared input, computed on the lane's worker until first needed."""

    __slots__ = ("features", "_future", "_value", "_work")

    def __init__(self, features, future: Future | None = None, value: Any = None,
                 work: Callable[[Any], Any] | None = None):
        self.features, self._future, self._value, self._work = features, future, value, work

    @property
    def value(self) -> Any:
        """The prepared input: the worker's (joined; its error, e.g. an ``InputError``, re-raised), or, when the
        worker has not started it yet (a thread still waiting for a core on a busy machine), computed here by the
        same work: no hand-over to wait for."""
        if self._future is not None:
            self._value = self._work(self.features) if self._future.cancel() else self._future.result()
            self._future = self._work = None
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
    """One form's queue of upcoming batches, in step order, with its worker thread (or a producer thread of its own
    that :meth:`put` s prepared batches, e.g. the host parameter server).

    ``max_ahead``: batches kept at most; when full, a push first drops the oldest batches ``droppable`` says may go
    (never consumed: a step that did not run)."""

    def __init__(self, pipeline: InputPipeline, name: str, max_ahead: int, droppable: Callable[[Ahead], bool]):
        self.pipeline, self.name, self.max_ahead, self.droppable = pipeline, name, max_ahead, droppable
        self._queue: deque[Ahead] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._fed = threading.Condition()  # a producer's puts and its end
        self._ended = False

    def push(self, features, work: Callable[[Any], Any], background: bool = True) -> None:
        """Queue ``features`` and prepare them with ``work`` (on the worker, or now without ``background``)."""
        while len(self._queue) >= self.max_ahead and self.droppable(self._queue[0]):
            self._queue.popleft()
        if not background:
            self._queue.append(Ahead(features, value=work(features)))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.pipeline.name}-{self.name}")
        self._queue.append(Ahead(features, future=self._pool.submit(work, features), work=work))

    def put(self, features, value: Any) -> None:
        """Queue a batch a producer thread prepared (``value``), waking :meth:`wait_head`."""
        with self._fed:
            self._queue.append(Ahead(features, value=value))
            self._fed.notify_all()

    def end(self) -> None:
        """The producer queues no more batches (until :meth:`close`)."""
        with self._fed:
            self._ended = True
            self._fed.notify_all()

    def wait_head(self, timeout_s: float, failed: Callable[[], BaseException | None] = lambda: None) -> Ahead | None:
        """The oldest queued batch, waiting for the producer to put one; ``None`` once it ended without more.
        ``failed``: the producer's error, if it stopped with one (raised here)."""
        deadline = time.monotonic() + timeout_s
        with self._fed:
            while not self._queue:
                err = failed()
                if err is not None:
                    raise err
                if self._ended:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaneTimeout(f"input pipeline lane {self.name!r}: no batch within {timeout_s:.0f} s")
                self._fed.wait(min(left, 0.5))
            return self._queue[0]

    def head(self) -> Ahead | None:
        """The oldest queued batch, or ``None``."""
        return self._queue[0] if self._queue else None

    def pop(self) -> Ahead:
        """Remove and return the oldest queued batch."""
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Forget the queued batches and stop the worker (after the running preparation); a producer may feed the
        lane again."""
        with self._fed:
            self._queue.clear()
            self._ended = False
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def leave(self) -> None:
        """Close the lane and take it off its pipeline (its form prefetches on another lane from now on)."""
        self.close()
        if self in self.pipeline.lanes:
            self.pipeline.lanes.remove(self)


class LaneTimeout(EmbedscaleError, RuntimeError):
    """A lane's producer put no batch in time."""


class InputPipeline:
    """The lanes of every form that prepares batches ahead, and the form a run hands each upcoming batch to (see
    the module docstring)."""

    def __init__(self, name: str = "input"):
        self.name = name
        self.lanes: list[Lane] = []
        self.entry = None  # the form whose ``prefetch(features)`` takes each upcoming batch (``drive``)
        self.prefetched = 0  # batches handed to the entry

    def lane(self, name: str, max_ahead: int, droppable: Callable[[Ahead], bool] = lambda a: True) -> Lane:
        """A new lane for one form."""
        lane = Lane(self, name, max_ahead, droppable)
        self.lanes.append(lane)
        return lane

    def find(self, name: str) -> Lane | None:
        """The (first) lane called ``name``, or ``None``."""
        return next((lane for lane in self.lanes if lane.name == name), None)

    def drive(self, entry) -> None:
        """Hand every upcoming batch to ``entry`` (a form with ``prefetch(features)`` and
        ``attach_input_pipeline(pipeline)``, which opens its lanes, and its inner forms', here)."""
        entry.attach_input_pipeline(self)
        self.entry = entry

    def prefetch(self, batch) -> None:
        """``batch`` (a ``Batch``) is an upcoming training step's: its features go to the entry form now. Behind the
        host lane, the entry gets the selection of the batch the host server made (the lane's head, the batch the
        loop peeked), the objects the lookup of that step gets."""
        if self.entry is None:
            return
        host = self.find("host")
        if host is None:
            self.entry.prefetch(batch.sparse)
        else:
            head = host.head()
            if head is None or head.features is not batch:
                raise EmbedscaleError(f"input pipeline {self.name!r}: behind the host lane only the batch the loop "
                                      "peeked (the lane's head) can be prefetched")
            self.entry.prefetch(head.value[0])
        self.prefetched += 1

    def pending(self) -> int:
        """Batches queued on every lane."""
        return sum(len(lane) for lane in self.lanes)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()


def not_pipelined(*, enabled: bool, entry: bool, host_depth: int = 0, host_entry: bool = True,
                  managed: bool = False) -> str | None:
    """Why a run does not run its input pipeline, or ``None`` when it does: the one place that decides it.

    The pipeline runs for both transports (over PGAS the sharded rows have nothing to prepare ahead,
    ``PgasShardedEmbedding.prefetch``; TT inputs still do), both designs (the send design's next batch decoded
    ahead, its counts riding the pooled exchange and its ids the gradient exchange: two all-to-alls a step
    instead of four), sharded, TT, host and managed tables, streams and live re-planning. It does not run when

    * the run asks for none (``enabled``: ``dist.input_pipeline``);
    * no form prepares a batch ahead (``entry``: the device module is a sharded module or a ``MixedEmbedding``);
    * host tables run at pipeline depth 1 (``host_depth``): EL-Rec's sequential schedule takes a batch from the
      loader only after the backward of the step before, so no batch is known during the step before its own;
      or the host pipeline's device side is not the entry form alone (``host_entry``); or managed tables sit
      beside host tables (``managed``): their mapping would rename ids the host server already read ahead.

    Per step, :func:`held_back` says which batches the run does not hand over.
    """
    if not enabled:
        return "dist.input_pipeline is false"
    if not entry:
        return "no form of the run prepares a batch ahead"
    if host_depth == 1:
        return ("host tables at pipeline depth 1: the host server takes a batch from the loader only after the "
                "step before's backward")
    if host_depth and not host_entry:
        return "the host pipeline's device side is not one module the input pipeline drives"
    if host_depth and managed:
        return "managed tables beside host tables: their mapping renames ids the host server read ahead"
    return None


def held_back(step: int, *, migrates: bool = False, managed: bool = False, eval_every: int = 0,
              checkpoint_every: int = 0) -> bool:
    """Whether a pipelined run keeps the batch of step ``step`` (0-based: ``step`` steps trained before it) from
    its input pipeline during the step before, so that nothing is in flight between the two steps:

    * a live re-plan may migrate the rows before it or before the step before it (``migrates``: the drift
      monitor's :meth:`~embedscale.train.replan.DriftMonitor.may_migrate_before`, which knows the checks in
      flight and the ones that may still start): a prefetched batch's requests name rows by the old address map;
    * managed tables (``managed``) and the run is evaluated or checkpointed between the two steps (``step`` a
      multiple of ``eval_every`` or ``checkpoint_every``): the mapping would already hold the ids of a batch not
      trained yet (``embedding.managed_lookup``).

    The loop itself never hands over the batch after the last step of a pass or of the run."""
    def at(every: int) -> bool:
        return bool(every) and step % every == 0

    return migrates or (managed and (at(eval_every) or at(checkpoint_every)))
