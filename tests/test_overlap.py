"""The embedding's row exchange overlapped with the bottom MLP (OPER 5.2), on 2 gloo ranks.

A DLRM over ``ShardedEmbedding`` (retrieve design, replicated hot rows, row-wise Adagrad) in DDP, trained a few
steps with the overlap (``model.overlap``, the default: the row all-to-all started before the bottom MLP, waited
for after it) and without it (the bottom MLP, then the whole lookup): the reference. The losses, logits, rows,
optimizer state and dense weights must be the same bits, with and without the next batch prefetched (the row
exchange then carries its counts), and the overlapped run must really start the exchange before the bottom
MLP runs (no all-to-all of the forward is called after the bottom MLP; without the overlap, the rows' is),
except while the next batch is still being decoded on the input pipeline's worker: then the bottom MLP
overlaps that decoding and the exchange starts after it (a decoding held until the bottom MLP ran never
makes the step wait for it). In the backward (``overlap_backward``), the overlapped run starts the gradient
all-to-all before the bottom MLP's backward and updates the rows after it (the exchange in flight beside it);
without the overlap the rows are updated before the bottom MLP's backward begins.
"""

import threading

import numpy as np
import torch

from embedscale.train.launch import spawn_local

STEPS, B, DIM = 4, 32, 4
# the next batch prefetched: no; decoded in the step; on the worker thread; there, held until the bottom MLP ran
PREFETCH = (None, "inline", "thread", "gated")
ROWS = [50, 9, 120]


def _tables():
    from embedscale.specs import TableSpec

    return [TableSpec("t0", ROWS[0], DIM, features=["f0"]), TableSpec("t1", ROWS[1], DIM, features=["f1", "f2"]),
            TableSpec("t2", ROWS[2], DIM, features=["f3"])]


def _batches():
    from embedscale.data.batch import JaggedFeatures

    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        vals, lens = [], []
        for rows in (ROWS[0], ROWS[1], ROWS[1], ROWS[2]):
            n = torch.randint(0, 3, (B,), generator=g)
            vals.append((torch.rand(int(n.sum()), generator=g) ** 3 * rows).long())  # skewed: hot rows 0, 1, ...
            lens.append(n)
        jf = JaggedFeatures(["f0", "f1", "f2", "f3"], torch.cat(vals), torch.cat(lens))
        out.append((jf, torch.randn(B, 5, generator=g), (torch.rand(B, generator=g) < 0.3).float()))
    return out


def _run(rank, world, overlap, prefetch, log):
    import torch.distributed as dist
    import torch.nn.functional as F

    from embedscale.comm.collective import CollectiveTransport
    from embedscale.embedding.address_map import AddressMap
    from embedscale.embedding.sharded import ShardedEmbedding
    from embedscale.models.dlrm import DLRM
    from embedscale.train.distributed import dense_ddp

    ts = _tables()
    rng = np.random.default_rng(5)
    owner = [rng.integers(0, world, r) for r in ROWS]
    replicas = [np.array([0, 1]), np.array([0]), np.array([0, 1, 2])]
    amap = AddressMap.build(ts, world, owner, replicas, None)
    emb = ShardedEmbedding(ts, amap, CollectiveTransport(group=dist.new_group(backend="gloo")), rank,
                           optimizer="rowwise_adagrad", lr=0.1, grad_sync="alltoall")
    torch.manual_seed(0)
    model = DLRM(5, emb, DIM, bottom_mlp=[8], top_mlp=[8], first_order=True)
    model.overlap = overlap
    emb.overlap_backward = overlap  # (off by default)
    model.dense_arch.register_forward_pre_hook(lambda *_: log.append("bottom_mlp"))
    model.dense_arch.register_forward_hook(lambda *_: log.append("bottom_mlp_done"))
    model.dense_arch.model[0].weight.register_hook(lambda g: log.append("bottom_mlp_backward_done"))
    update = emb.update
    emb.update = lambda ctx: (log.append("update"), update(ctx))[1]
    if prefetch == "gated":  # the next batch's decoding held until this step's bottom MLP ran (at most 10 s)
        gate, decode = threading.Event(), emb._decode_ahead

        def gated(features):
            if not gate.wait(10):
                log.append("decode_waited_out")
            gate.clear()
            return decode(features)
        emb._decode_ahead = gated
        model.dense_arch.register_forward_hook(lambda *_: gate.set())
    ddp = dense_ddp(model, emb)
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    data = _batches()
    lo, hi = B * rank // world, B * (rank + 1) // world
    part = [(jf.slice_batch(lo, hi), x[lo:hi], y[lo:hi]) for jf, x, y in data]
    losses, logits = [], []
    for s, (jf, x, y) in enumerate(part):
        if prefetch and s + 1 < STEPS:  # decoded now ("inline") or on the input pipeline's worker ("thread")
            emb.prefetch(part[s + 1][0], background=prefetch != "inline")
        z = ddp(x, jf)
        log.append("forward_done")
        loss = F.binary_cross_entropy_with_logits(z, y, reduction="sum") / B
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        logits.append(z.detach().clone())
    dense = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}
    return losses, logits, emb.weight.clone(), emb.momentum.clone(), dense


def _worker(rank, world):
    import torch.distributed as dist

    real = dist.all_to_all_single
    log: list[str] = []

    def logged(*a, **k):  # the all-to-alls in call order
        log.append("a2a")
        return real(*a, **k)

    dist.all_to_all_single = logged
    out = {}
    try:
        for prefetch in PREFETCH:
            for overlap in (False, True):
                log.clear()
                out[(overlap, prefetch)] = (_run(rank, world, overlap, prefetch, log), list(log))
    finally:
        dist.all_to_all_single = real
    return out


def _all_to_alls_after_bottom_mlp(log: list[str]) -> list[int]:
    """Per step, the all-to-alls the forward calls after its bottom MLP (none when every exchange of the lookup
    was started before it)."""
    out, n, inside = [], 0, False
    for e in log:
        if e == "bottom_mlp_done":
            n, inside = 0, True
        elif e == "forward_done":
            out.append(n)
            inside = False
        elif inside and e.startswith("a2a"):
            n += 1
    return out


def _backward_order(log: list[str]) -> list[tuple[bool, bool]]:
    """Per step's backward (after its forward): whether an all-to-all was called before the bottom MLP's backward
    finished, and whether the rows were updated after it."""
    out, phase = [], None
    for e in log:
        if e == "forward_done":
            phase = {"a2a_before": False, "update_after": False, "done": False}
        elif phase is None:
            continue
        elif e == "bottom_mlp_backward_done":
            phase["done"] = True
        elif e.startswith("a2a") and not phase["done"]:
            phase["a2a_before"] = True
        elif e == "update":
            phase["update_after"] = phase["done"]
            out.append((phase["a2a_before"], phase["update_after"]))
            phase = None
    return out


def test_overlapped_rows_exchange_gives_the_same_bits():
    results = spawn_local(_worker, 2, timeout_s=600)
    for rank, res in enumerate(results):
        for prefetch in PREFETCH:
            (ref, ref_log), (got, got_log) = res[(False, prefetch)], res[(True, prefetch)]
            what = f"rank {rank}, prefetch {prefetch}"
            for s in range(STEPS):
                assert torch.equal(got[0][s], ref[0][s]), f"{what}: loss of step {s} {got[0][s]} != {ref[0][s]}"
                assert torch.equal(got[1][s], ref[1][s]), f"{what}: logits of step {s} differ"
            assert torch.equal(got[2], ref[2]), f"{what}: embedding rows differ after {STEPS} steps"
            assert torch.equal(got[3], ref[3]), f"{what}: row-wise Adagrad state differs"
            for k, v in ref[4].items():
                assert torch.equal(got[4][k], v), f"{what}: dense weight {k} differs"
            assert ref[2].abs().sum() > 0 and not torch.equal(ref[1][0], ref[1][-1])  # the steps trained something
            # the overlap is real: the row all-to-all is started before the bottom MLP, not after it
            assert min(_all_to_alls_after_bottom_mlp(ref_log)) >= 1, f"{what}: {ref_log}"
            if prefetch in (None, "inline"):  # (on the worker: started early only if the next batch is decoded)
                assert _all_to_alls_after_bottom_mlp(got_log) == [0] * STEPS, f"{what}: {got_log}"
            # the backward: the gradient exchange in flight beside the bottom MLP's backward, the update after it
            assert _backward_order(got_log) == [(True, True)] * STEPS, f"{what}: {got_log}"
            assert _backward_order(ref_log) == [(True, False)] * STEPS, f"{what}: {ref_log}"
            # the overlap never waits for the next batch's decoding before the bottom MLP
            assert "decode_waited_out" not in got_log + ref_log, f"{what}: {got_log}"
