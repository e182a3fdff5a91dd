"""Pipelined training: the server prefetches host rows ``depth - 1`` batches ahead while the trainer computes.

EL-Rec (SC 2022) section V, Fig. 9 and Fig. 16. One server thread per pass runs the parameter server's
schedule over the batches (PyTorch ops release the GIL, so it computes beside the trainer)::

    for s = 0, 1, ...:
        if s >= depth: pull the gradients of batch s - depth from the gradient queue and apply them
        take batch s from the loader; read its host rows; put them on the prefetch queue
                                                                     (applied(s) = max(0, s - depth + 1))
    then pull and apply the remaining gradients

and the trainer, for each batch, takes it from the prefetch queue with its rows patched from the life-cycle
cache (:mod:`embedscale.pipeline.cache`), trains on it (the host rows' gradients go up the gradient queue
during backward) and moves on. The patch of batch ``s`` needs the cache entry of batch ``s - 1``, complete
when that batch's gradients are pushed; a patcher thread between the prefetch queue and the trainer patches
batch ``s`` as soon as they are, so the patch runs beside the rest of the trainer's step ``s - 1`` (the rest
of its backward, the dense optimizer step) instead of on its critical path. So while the trainer computes batch ``t`` the server has batches up to
``t + depth - 1`` read, and applies batch ``t - 1``'s gradients; both queues hold at most ``depth``
items. ``depth = 1`` is sequential training (EL-Rec's "prefetch queue of length 1"): the server reads
batch ``t`` only after it applied batch ``t - 1``, so nothing is ever stale and the cache stays off.
With ``depth >= 2``, rows read before the updates of the batches in flight reached the server are stale,
and the cache patches them: the result is bit for bit that of sequential training.

:class:`PipelinedLoader` wraps any batch iterable (a ``ShardLoader``) so that any training loop runs
pipelined; :func:`embedscale.train.trainer.pipelined_trainer` is the single-process :class:`~embedscale.train.trainer.Trainer`
with its training loader wrapped.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Iterable, Iterator


from embedscale.data.batch import Batch
from embedscale.embedding.input_pipeline import InputPipeline, Lane, LaneTimeout
from embedscale.errors import ConfigError
from embedscale.pipeline.embedding import PipelinedEmbedding
from embedscale.pipeline.queues import END, FINISH, GradientBatch, PipelineError, PrefetchedBatch, get_from


_LOOKAHEAD_DEPTH = ("a pipeline's lookahead needs depth >= 2 (at depth 1 the server takes a batch from the loader "
                    "only after the trainer's backward of the one before)")


class Pipeline:
    """One pass of pipelined training over ``batches`` (use through :class:`PipelinedLoader`).

    Args:
        embedding: the model's :class:`PipelinedEmbedding`.
        batches: the batches of the pass, in training order.
        depth: prefetch queue length ``k`` (1 = sequential).
        use_cache: patch stale prefetched rows from the life-cycle cache. Off, pipelined training at
            ``depth >= 2`` reads stale rows and no longer equals sequential training (tests show it).
        timeout_s: a queue that stays empty this long is an error, not a hang.
        lookahead: the ``host`` lane of an input pipeline (``embedding.input_pipeline``; ``True``: one of its own):
            the server puts every batch it takes from the loader there, with its device modules' features, before
            it waits for older gradients; :meth:`peek` gives the trainer the batch after the one it trains, so the
            device modules prepare its input during this step (depth >= 2).

    Attributes:
        stats: after the pass: batches, rows patched, cache peak rows, seconds the trainer waited for the
            server (``wait_s``), the server waited for gradients (``server_wait_s``) and the server thread's
            CPU time (``server_cpu_s``) and the patcher thread's (``patcher_cpu_s``).
    """

    def __init__(self, embedding: PipelinedEmbedding, batches: Iterable, depth: int, *, use_cache: bool = True,
                 timeout_s: float = 300.0, lookahead: bool | Lane = False) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"pipeline depth must be an integer >= 1, got {depth!r}")
        if lookahead is not False and depth < 2:
            raise ConfigError(_LOOKAHEAD_DEPTH)
        if embedding.pipelined:
            raise PipelineError("this PipelinedEmbedding already runs a pipeline")
        self.embedding = embedding
        self.server = embedding.server
        self.batches = batches
        self.depth = depth
        self.use_cache = use_cache
        self.timeout_s = timeout_s
        self.prefetch_q: queue.Queue = queue.Queue()
        self.grad_q: queue.Queue = queue.Queue()
        self.applied = 0  # server side: gradient batches applied
        self.consumed = 0  # trainer side: batches handed out
        self.pushed = 0  # trainer side: gradient batches sent
        self._finished = False  # server side: the trainer sent FINISH
        self.error: BaseException | None = None
        self._applied_cv = threading.Condition()
        self._plan_patches = False
        self._async_patch = False  # a patcher thread patches prefetched rows (cache on, depth > 1)
        self.ready_q: queue.Queue = queue.Queue()
        self._pushed_cv = threading.Condition()
        self._stopping = False
        self.patcher = threading.Thread(target=self._patch_loop, name="embedscale-cache-patcher", daemon=True)
        self._serving = True
        self.thread = threading.Thread(target=self._serve, name="embedscale-parameter-server", daemon=True)
        # lookahead: the server takes batch s from the loader (and selects its device modules' features) before
        # it waits for the gradients of batch s - depth, and puts it on the host lane of the input pipeline
        self.lane: Lane | None = None
        if lookahead is not False:
            self.lane = lookahead if isinstance(lookahead, Lane) else InputPipeline("host").lane("host", depth + 1)
            self.lane.close()  # this pass's batches only
        self.lookahead = self.lane is not None
        self.stats = {"batches": 0, "patched_rows": 0, "cache_peak_rows": 0, "wait_s": 0.0, "server_wait_s": 0.0,
                      "server_cpu_s": 0.0, "patcher_cpu_s": 0.0}

    # -- server thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        it = iter(self.batches)
        cpu0 = time.thread_time()
        recent: collections.deque = collections.deque()  # (batch, rows per group) of batches in flight
        s = 0
        try:
            while True:
                dev = None
                if self.lane is not None:  # the loader first: the trainer may peek at this batch during step s - 1
                    batch = next(it, None)
                    if batch is None:
                        self.lane.end()
                        break
                    dev = self.embedding.device_features(batch.sparse)
                    self.lane.put(batch, dev)
                # the gradient due first, then the loader: a gradient pushed is applied whatever the loader does
                if s >= self.depth and not self._pull_and_apply(s - self.depth):
                    break
                if not self.lookahead:
                    batch = next(it, None)
                    if batch is None:
                        break
                in_flight = None
                if self._plan_patches:
                    while recent and recent[0][0] < self.applied:
                        recent.popleft()
                    in_flight = list(recent)
                pre = self.embedding.prefetch(batch.sparse, index=s, applied=self.applied, batch=batch,
                                              in_flight=in_flight, device_features=dev)
                if self._plan_patches:
                    recent.append((s, [hr.rows.to(self.embedding.server.device) for hr in pre.host]))
                self.prefetch_q.put(pre)
                s += 1
            self.prefetch_q.put(END)
            while self._pull_and_apply(None):
                pass
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            self.error = e
            self.prefetch_q.put(e)
        finally:
            self.stats["server_cpu_s"] = time.thread_time() - cpu0
            if self.lane is not None:
                self.lane.end()
            with self._applied_cv:
                self._serving = False
                self._applied_cv.notify_all()
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass

    def _pull_and_apply(self, expected: int | None) -> bool:
        """Pull one gradient batch and apply it; False when the trainer has finished (nothing more comes)."""
        if self._finished:
            return False
        t0 = time.perf_counter()
        item = self.grad_q.get()  # the trainer always ends with FINISH
        self.stats["server_wait_s"] += time.perf_counter() - t0
        if item is FINISH:
            self._finished = True
            return False
        if item.index != self.applied or (expected is not None and item.index != expected):
            raise PipelineError(f"gradient of batch {item.index} arrived, the server expected batch {self.applied}")
        if self.server is not None:
            self.server.apply(item)
        with self._applied_cv:
            self.applied += 1
            self._applied_cv.notify_all()
        return True

    # -- patcher thread ------------------------------------------------------------------------------
    def _patch_loop(self) -> None:
        """Take prefetched batches in order; patch batch ``s`` from the cache once the trainer has pushed the
        gradients of batch ``s - 1`` (its cache entry is complete then); hand it to the trainer."""
        cpu0 = time.thread_time()
        try:
            while True:
                item = self.prefetch_q.get()  # the server always ends with END or its exception
                if item is END or isinstance(item, BaseException):
                    self.ready_q.put(item)
                    return
                with self._pushed_cv:
                    while self.pushed < item.index and not self._stopping:
                        self._pushed_cv.wait(0.5)
                    if self._stopping:
                        return
                item.patched = self.embedding._patch(item)
                self.ready_q.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer
            self.ready_q.put(e)
        finally:
            self.stats["patcher_cpu_s"] = time.thread_time() - cpu0

    def wait_applied(self) -> None:
        """Block until the server has applied every gradient pushed so far (a synchronous read of the host
        tables without the cache: depth 1, where the server pulls each gradient as soon as it is pushed)."""
        deadline = time.monotonic() + self.timeout_s
        with self._applied_cv:
            while self.applied < self.pushed and self._serving:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(f"the server applied {self.applied} of {self.pushed} gradient batches "
                                        f"within {self.timeout_s:.0f} s")
                self._applied_cv.wait(min(left, 0.5))
        if self.error is not None:
            raise self.error

    # -- trainer side --------------------------------------------------------------------------------
    def start(self) -> None:
        emb = self.embedding
        emb.cache.reset()
        emb._pending = None
        emb._sink = self._push
        emb._track_updates = self.use_cache and self.depth > 1
        # one rank: a cache entry holds exactly the rows its batch read, which the server knows, so it can
        # plan the patches; with several ranks entries also hold rows other ranks updated
        self._plan_patches = emb._track_updates and emb.server is not None and emb._group() is None
        self._async_patch = emb._track_updates and emb.server is not None
        # reads outside the schedule (evaluation, checkpoints): the cache has what the server lacks at
        # depth >= 2; at depth 1 the server lags by at most the last gradient, so wait for it
        emb._sync_read_hook = None if emb._track_updates else self.wait_applied
        self.thread.start()
        if self._async_patch:
            self.patcher.start()

    def _push(self, grads: GradientBatch) -> None:
        if grads.index != self.pushed:
            raise PipelineError(f"backward of batch {grads.index} while batch {self.pushed} was expected")
        with self._pushed_cv:
            self.pushed += 1
            self._pushed_cv.notify_all()
        self.grad_q.put(grads)

    def next(self) -> PrefetchedBatch | None:
        """The next prefetched batch, patched and attached to the embedding; ``None`` at the end of the pass."""
        if self.pushed != self.consumed:
            raise PipelineError(f"batch {self.consumed - 1} was handed out but its backward never ran "
                                "(the pipeline needs exactly one forward and one backward per batch)")
        t0 = time.perf_counter()
        if self._async_patch:
            item = get_from(self.ready_q, self.patcher, "waiting for prefetched, patched rows", self.timeout_s)
        else:
            item = get_from(self.prefetch_q, self.thread, "waiting for prefetched rows", self.timeout_s)
        self.stats["wait_s"] += time.perf_counter() - t0
        if item is END:
            return None
        if isinstance(item, BaseException):
            raise item
        if item.index != self.consumed:
            raise PipelineError(f"prefetched batch {item.index} arrived, batch {self.consumed} was expected")
        if self._async_patch:  # patched by the patcher thread
            self.embedding.attach(item, patch=False)
            self.stats["patched_rows"] += item.patched
        elif self.use_cache:
            self.stats["patched_rows"] += self.embedding.attach(item)
        else:
            self.embedding._pending = item
        self.consumed += 1
        if self.lane is not None and len(self.lane) and self.lane.head().features is item.batch:
            self.lane.pop()  # (the lane's head is the next batch from here on)
        return item

    def peek(self) -> tuple | None:
        """``(batch, device features)`` of the batch the next :meth:`next` hands out, taken from the loader by
        the server (the host lane's head); ``None`` at the end of the pass. Waits for the server, which takes that
        batch as soon as it has put the one before on the prefetch queue: before the trainer could train on it."""
        if self.lane is None:
            raise PipelineError("peek needs a pipeline with lookahead")
        try:
            head = self.lane.wait_head(self.timeout_s, lambda: self.error)
        except LaneTimeout:
            raise PipelineError(f"the server took no batch {self.consumed} from the loader within "
                                f"{self.timeout_s:.0f} s") from None
        return None if head is None else (head.features, head.value)  # (next() pops each batch it hands out)

    def finish(self) -> None:
        """Tell the server no more gradients come, wait until it has applied all it got, detach."""
        emb = self.embedding
        self.grad_q.put(FINISH)
        if self.thread.is_alive():
            self.thread.join(self.timeout_s)
        if self.patcher.is_alive():  # the server has put END by now; or the patcher waits for a push
            with self._pushed_cv:
                self._stopping = True
                self._pushed_cv.notify_all()
            self.patcher.join(self.timeout_s)
        self.stats["batches"] = self.pushed
        self.stats["cache_peak_rows"] = emb.cache.peak_rows
        self.stats["cache_hits"] = emb.cache.hits
        emb._sink = None
        emb._pending = None
        emb._track_updates = False
        emb._sync_read_hook = None
        if self.thread.is_alive():
            raise PipelineError(f"the parameter server thread did not finish within {self.timeout_s:.0f} s")
        emb.cache.reset()  # every gradient is applied: the server is current
        if self.lane is not None:
            self.lane.close()
        if self.error is not None and not isinstance(self.error, PipelineError):
            pass  # already raised on the trainer side through the prefetch queue


class PipelinedLoader:
    """Wrap a batch loader so that iterating it runs a :class:`Pipeline` over its batches.

    Each ``iter()`` is one pass (epoch): the server thread starts, reads ``loader``'s batches and their
    host rows ahead, and applies gradients; the batches come out in order, each already attached to the
    embedding, so the training step is the usual ``model(batch.dense, batch.sparse)``, loss, ``backward``.
    When the pass ends (or the loop breaks out), every gradient received is applied before control returns.
    ``len`` and ``set_epoch`` pass through to ``loader``.

    Args:
        loader: the batches (a ``ShardLoader`` or any iterable of ``Batch``).
        embedding: the model's :class:`PipelinedEmbedding`.
        depth: prefetch queue length (1 = sequential).
        use_cache: see :class:`Pipeline`.
        lookahead: during a step, :meth:`peek` gives the batch of the next one (depth >= 2; see
            :class:`Pipeline`): the device modules' input pipeline runs behind the host pipeline.
        inputs: the run's input pipeline, on which the lookahead opens its ``host`` lane (default: one of its own).

    Attributes:
        last_stats: the finished pass's :attr:`Pipeline.stats`.
    """

    def __init__(self, loader, embedding: PipelinedEmbedding, depth: int = 2, *, use_cache: bool = True,
                 timeout_s: float = 300.0, lookahead: bool = False, inputs: InputPipeline | None = None) -> None:
        if not isinstance(embedding, PipelinedEmbedding):
            raise ConfigError(f"PipelinedLoader needs a PipelinedEmbedding, got {type(embedding).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"pipeline depth must be an integer >= 1, got {depth!r}")
        if lookahead and depth < 2:
            raise ConfigError(_LOOKAHEAD_DEPTH)
        self.loader = loader
        self.embedding = embedding
        self.depth = depth
        self.use_cache = use_cache
        self.timeout_s = timeout_s
        self.lookahead = lookahead
        # the host lane: every pass's lookahead on it (the run's input pipeline, or one of its own)
        self.lane = (inputs or InputPipeline("host")).lane("host", depth + 1) if lookahead else None
        self.last_stats: dict = {}
        self.pipeline: Pipeline | None = None
        self._peeked: tuple | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def peek(self) -> Batch | None:
        """The batch this pass hands out next (``None`` at its end), before it is handed out: a loop with an
        input pipeline passes it to the run during the current step (lookahead only)."""
        if self.pipeline is None or not self.lookahead:
            raise PipelineError("peek needs a running pass of a PipelinedLoader made with lookahead=True")
        self._peeked = self.pipeline.peek()
        return None if self._peeked is None else self._peeked[0]

    def device_features(self, batch: Batch) -> list:
        """The device modules' features of ``batch``: those the server selected when ``batch`` is the one
        :meth:`peek` returned (the objects the lookup will get), else selected now."""
        if self._peeked is not None and self._peeked[0] is batch:
            return self._peeked[1]
        return self.embedding.device_features(batch.sparse)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.loader.set_epoch(epoch, skip_batches=skip_batches)

    def __iter__(self) -> Iterator[Batch]:
        pipe = Pipeline(self.embedding, self.loader, self.depth, use_cache=self.use_cache, timeout_s=self.timeout_s,
                        lookahead=self.lane if self.lane is not None else False)
        self.pipeline = pipe
        pipe.start()
        try:
            while True:
                pre = pipe.next()
                if pre is None:
                    return
                yield pre.batch
        finally:
            pipe.finish()
            self.last_stats = dict(pipe.stats)
