"""Host synchronisations per steady sharded training step, counted on CPU as a CUDA run would make them.

A host synchronisation is a point where the host waits for the device: it reads a value the device computed
(``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, a copy to host memory) or calls an op whose
output size depends on the data (``nonzero``, ``unique``, ``masked_select``, indexing with a boolean mask, a
``repeat_interleave`` without ``output_size``, ``bincount``, which reads its input's maximum). ``SyncCounter``
is a ``TorchDispatchMode`` that counts these aten ops, plus the Python-level reads of a tensor's data that
dispatch no op on CPU (``tolist``, ``numpy``, ``__array__``, ``cpu``, ``to(HOST)``), on the thread that runs
the step. On CPU none of them waits for anything; the count is what the same step would make on CUDA.

What is not a synchronisation, by design (the rule): work on data that is in host memory on a CUDA run too.
The counter tracks which tensors are device-side: the module's storage and optimizer state, the dense
inputs of the step's loss, whatever a collective sent or received (the ``c10d`` ops), and every tensor an op
computed from a device-side tensor (in-place results included). Everything else is host-side: the batch's
features as the input pipeline hands them over, the address map and the per-feature tables (OPER 5.1 keeps
them in host memory; ``ShardedEmbedding.host_tensors``), and what the host computes from those alone (the
ids' conversion, before the decoded batch crosses to the device once). A sync op counts only when one of its
inputs is device-side. The input pipeline's worker thread, which converts the next batch while the step runs,
is not seen at all (dispatch modes are per thread). A tensor a factory made on the device and that never met
device data counts as host-side (on CPU the two look the same): a small undercount the rule accepts.

The C++ CPU kernel (``cpu_kernel``) runs on host memory only, so the count is taken on the PyTorch ops that a
CUDA run takes (``cpu_kernel = False``). The bar: at most 3 per steady (prefetched) step of a sharded
embedding on 2 ranks, in both designs, for every replica gradient sync (``BAR``); the send design's step makes
exactly the reads counted by hand in ``SEND_READS``; the counted steps give the same bits as the C++
kernel's (outputs and rows).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from embedscale import device as device_mod
from embedscale.comm.collective import CollectiveTransport
from embedscale.embedding.address_map import AddressMap
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.train.launch import spawn_local

from test_sharded import B, EPS, LR, batches, plans, tables

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten._unique, aten._unique2, aten.unique_dim,
            aten.unique_consecutive, aten.unique_dim_consecutive, aten.masked_select, aten.bincount,
            aten.equal, aten.nonzero_numpy}
BAR = {"retrieve": 3, "send": 3}
# the send design's step, by hand: the swapped counts read once (values, partial bags and distinct rows per
# peer: every size of the step), the number of rows the fused update applies; with replicas, the replica sync's
# union (``local_aggregated``: the bitmap's set rows) or the ranks' pair counts (``allgather``); ``dense`` none
SEND_READS = {"local_aggregated": ["tolist", "nonzero", "_local_scalar_dense"],
              "dense": ["tolist", "_local_scalar_dense"],
              "allgather": ["tolist", "tolist", "_local_scalar_dense"]}
NO_REPLICAS = ["tolist", "_local_scalar_dense"]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SyncCounter(TorchDispatchMode):
    """Counts host synchronisations on this thread (module docstring); ``where`` lists ``(op, library line)``;
    ``device`` seeds the device-side tensors."""

    def __init__(self, device: list[torch.Tensor] = ()):
        super().__init__()
        self.dev: dict[int, list] = {}  # storage address -> weak references to device-side tensors on it
        for t in device:
            self._mark(t)
        self.where: list[tuple[str, str]] = []
        self.thread = threading.get_ident()
        self._saved = {}

    def _mark(self, t: torch.Tensor) -> None:
        if t.numel():
            self.dev.setdefault(_ptr(t), []).append(weakref.ref(t))

    def on_device(self, t: torch.Tensor) -> bool:
        """Device-side: a live device-side tensor shares its storage (a freed address reused by a new host
        tensor is not mistaken for one)."""
        refs = self.dev.get(_ptr(t)) if t.numel() else None
        return bool(refs) and any(r() is not None for r in refs)

    def _hit(self, what: str) -> None:
        import traceback

        lib = [f for f in traceback.extract_stack()[:-2] if "/embedscale/" in f.filename]
        self.where.append((what, f"{lib[-1].filename.split('/embedscale/')[-1]}:{lib[-1].lineno}" if lib else "?"))

    def _syncs(self, func, args, kwargs) -> bool:
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            return True
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            idx = args[1] if len(args) > 1 else kwargs.get("indices")
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in idx)
        if packet is aten.repeat_interleave:
            return func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and \
                (len(args) < 2 or args[1] is None or isinstance(args[1], torch.Tensor))
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        collective = func.namespace == "c10d"
        device_side = collective or any(self.on_device(t) for t in ins)
        if device_side and self._syncs(func, args, kwargs):
            self._hit(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        if device_side:
            for t in tree_flatten(out)[0] + (ins if collective else []):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    # -- reads of a tensor's data that dispatch nothing on CPU ---------------------------------------------
    def _spy(self, name, pred=lambda a, k: True):
        real = getattr(torch.Tensor, name)
        self._saved[name] = real
        mode = self

        def spy(t, *a, **k):
            if threading.get_ident() == mode.thread and mode.on_device(t) and pred(a, k):
                mode._hit(name)
            return real(t, *a, **k)
        setattr(torch.Tensor, name, spy)

    def __enter__(self):
        def to_host(a, k):  # ``.to(HOST)``: the one spelling of a move to host memory (device.py)
            return any(x is device_mod.HOST for x in (*a, k.get("device")))
        for name in ("tolist", "numpy", "__array__", "cpu"):
            self._spy(name)
        self._spy("to", to_host)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)


def _worker(rank, world, scenarios, steps):
    torch.manual_seed(0)
    ts = tables()
    transport = CollectiveTransport()
    parts = [[jf.slice_batch(B * r // world, B * (r + 1) // world) for r in range(world)] for jf, _ in batches()]
    grads = [c for _, c in batches()]
    lo, hi = B * rank // world, B * (rank + 1) // world
    out = {}
    for name, design, sync, optimizer in scenarios:
        owner, replicas, holders = plans(world)[name]
        amap = AddressMap.build(ts, world, owner, replicas, holders)
        res = {}
        for counted in (False, True):
            emb = ShardedEmbedding(ts, amap, transport, rank, design=design, optimizer=optimizer, lr=LR, eps=EPS,
                                   grad_sync=sync)
            emb.cpu_kernel = not counted  # counted: the PyTorch ops, which a CUDA run takes; else the C++ kernel's
            # one counter for the whole loop: what a step received for a later one stays device-side
            cnt = SyncCounter([emb.weight, *emb.buffers(), *grads]) if counted else contextlib.nullcontext()
            per_step, outs = [], []
            with cnt:
                for s in range(steps):
                    b = s % len(parts)
                    n0 = len(cnt.where) if counted else 0
                    emb.prefetch(parts[(s + 1) % len(parts)][rank])  # the steady state: the next batch ahead
                    y = emb(parts[b][rank])
                    ((y * grads[b][lo:hi]).sum() / B).backward()
                    outs.append(y.detach().clone())
                    if counted:
                        per_step.append(cnt.where[n0:])
            res[counted] = (outs, emb.weight.clone(), per_step)
        out[(name, design, sync, optimizer)] = res
    return out


SCENARIOS = [("oper_replicas", "retrieve", "local_aggregated", "rowwise_adagrad"),
             ("partial_replicas", "retrieve", "alltoall", "sgd"),
             ("oper_replicas", "retrieve", "dense", "sgd"),
             ("oper_replicas", "retrieve", "allgather", "rowwise_adagrad"),
             ("oper_replicas", "send", "local_aggregated", "rowwise_adagrad"),
             ("partial_replicas", "send", "allgather", "rowwise_adagrad"),
             ("oper_replicas", "send", "dense", "sgd"),
             ("row_wise", "send", "local_aggregated", "sgd"),
             ("row_wise", "retrieve", "local_aggregated", "sgd")]


def test_a_steady_sharded_step_makes_at_most_3_host_synchronisations():
    """Retrieve design: one read of the next batch's request counts, one of the rows the optimizer updates,
    and the replica sync's union (``local_aggregated``) or gathered sizes (``allgather``). Send design: the
    reads of ``SEND_READS``, no more."""
    steps = 5
    results = spawn_local(_worker, 2, SCENARIOS, steps, timeout_s=600)
    for rank, res in enumerate(results):
        for sc, runs in res.items():
            plain, counted = runs[False], runs[True]
            # the same bits as the C++ kernel's step (itself checked against a single-process reference in
            # test_sharded): the counted path computes what it should, and the counter changes nothing
            for a, b in zip(plain[0], counted[0]):
                assert torch.equal(a, b), sc
            assert torch.equal(plain[1], counted[1]), sc
            per_step = counted[2]
            for s, where in enumerate(per_step[1:], 1):  # steady: the step's batch was prefetched
                assert len(where) <= BAR[sc[1]], (rank, sc, s, where)
                if sc[1] == "send":
                    want = NO_REPLICAS if sc[0] == "row_wise" else SEND_READS[sc[2]]
                    assert sorted(op for op, _line in where) == sorted(want), (rank, sc, s, where)


def test_the_counter_counts_device_side_reads_and_not_host_work():
    """Hand-listed: every kind of read counts once on a device-side tensor (and on what was computed from
    one), none on host-side tensors (so the step test can fail)."""
    dev = torch.arange(10)  # stands for a tensor on the accelerator
    host = torch.arange(10)
    with SyncCounter([dev]) as cnt:
        d = dev * 2  # device-side too
        int(d[3])
        d.tolist()
        torch.nonzero(d > 4)
        torch.unique(d)
        d[d > 4]
        d.to(device_mod.HOST)
        torch.repeat_interleave(d, d)
        torch.repeat_interleave(d, d, output_size=int(90))  # sized by the host: no sync
        h = host * 2
        int(h[3]), h.tolist(), torch.nonzero(h > 4), torch.unique(h), h[h > 4]  # host work: none counts
    assert [w for w, _ in cnt.where] == ["_local_scalar_dense", "tolist", "nonzero", "_unique2", "index", "to",
                                         "repeat_interleave"]
