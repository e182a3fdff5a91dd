"""What every transport gets from the base class (``comm.transport.Transport``): the count exchange, the packed
exchange of several tensors per peer, and their byte counts, checked on an in-process loopback transport (ranks as
threads) against hand-worked sends and counts."""

from __future__ import annotations

import threading

import numpy as np
import torch

from embedscale.comm.transport import Transport

W = 3


class Loopback(Transport):
    """Ranks as threads: ``exchange`` posts into a shared mailbox and waits for every rank (base counting)."""

    name = "loopback"

    def __init__(self, rank: int, box: dict, barrier: threading.Barrier):
        super().__init__(rank, W)
        self.box, self.barrier = box, barrier

    def exchange(self, send, recv_counts=None, kind="data"):
        for p in range(W):
            self.box[(self.rank, p)] = send[p].clone()
        self.barrier.wait()
        recv = [self.box[(p, self.rank)] for p in range(W)]
        self.barrier.wait()
        if recv_counts is not None:
            assert [int(r.shape[0]) for p, r in enumerate(recv) if p != self.rank] == \
                [c for p, c in enumerate(recv_counts) if p != self.rank]
        self._count(send, recv, kind)
        return recv


def _run(fn):
    box, barrier = {}, threading.Barrier(W)
    out, errors = [None] * W, []

    def main(r):
        try:
            out[r] = fn(Loopback(r, box, barrier))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


def test_count_exchange_returns_the_transposed_counts_counted_as_metadata():
    def fn(tr):
        counts = torch.tensor([[10 * tr.rank + p, p - tr.rank] for p in range(W)])
        return tr.exchange_counts(counts), tr.counter.snapshot()

    for r, (got, snap) in enumerate(_run(fn)):
        assert got.tolist() == [[10 * p + r, r - p] for p in range(W)]  # row p: what rank p sent here
        assert snap["meta"] == (W - 1) * 2 * 8  # one int64 row of 2 to every other rank: sent bytes only
        assert snap["sent_total"] == 0 and snap["recv_total"] == 0 and snap["by_kind"] == {}


def test_packed_exchange_unpacks_each_part_and_counts_it_under_its_kind():
    D = 4

    def fn(tr):
        me = tr.rank
        hdr = [torch.tensor([me, p]) for p in range(W)]
        rows = [torch.full((p + 1, D), float(10 * me + p)) for p in range(W)]
        ids = [torch.arange(me + 2) + 100 * p for p in range(W)]
        recv_parts = [[(torch.int64, (), 2), (torch.float32, (D,), me + 1), (torch.int64, (), p + 2)]
                      for p in range(W)]
        got = tr.exchange_packed([[hdr[p], rows[p], ids[p]] for p in range(W)], recv_parts, ["meta", "rows", "ids"])
        return got, tr.counter.snapshot()

    for r, (got, snap) in enumerate(_run(fn)):
        assert got[r] is None
        for p in range(W):
            if p == r:
                continue
            h, rows, ids = got[p]
            assert h.tolist() == [p, r]
            assert torch.equal(rows, torch.full((r + 1, D), float(10 * p + r)))
            assert ids.tolist() == (torch.arange(p + 2) + 100 * r).tolist()
        peers = [p for p in range(W) if p != r]
        rows_out = sum((p + 1) * D * 4 for p in peers)
        ids_out = (r + 2) * 8 * len(peers)
        assert snap["by_kind"] == {"rows": rows_out, "ids": ids_out}
        assert snap["meta"] == 2 * 16 * len(peers)  # headers: sent and received, as a count exchange's metadata
        assert snap["sent"] == [0 if p == r else (p + 1) * D * 4 + (r + 2) * 8 for p in range(W)]
        assert snap["recv"] == [0 if p == r else (r + 1) * D * 4 + (p + 2) * 8 for p in range(W)]
        assert np.sum(snap["sent"]) == rows_out + ids_out
