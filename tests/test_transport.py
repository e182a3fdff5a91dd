"""The transport's device contract: it knows the device its backend needs and callers get their device back."""

import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.comm.hierarchical import HostAwareTransport
from embedscale.comm.transport import Transport, backend_device
from embedscale.train.launch import spawn_local


def test_backend_device(monkeypatch):
    assert backend_device("gloo") == torch.device("cpu")
    assert backend_device("mpi") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backend_device("nccl") == torch.device("cuda", 3)
    assert backend_device("NCCL") == torch.device("cuda", 3)


class _Fixed(Transport):
    def __init__(self, dev):
        super().__init__(0, 1)
        self._dev = dev

    @property
    def wire_device(self):
        return self._dev

    def exchange(self, send, recv_counts=None, kind="data"):
        return send


def test_to_wire_moves_only_when_needed():
    t = torch.arange(5)
    assert _Fixed(None).to_wire(t) is t  # any device will do
    assert _Fixed(torch.device("cpu")).to_wire(t) is t  # already there
    moved = _Fixed(torch.device("meta")).to_wire(t)
    assert moved.device == torch.device("meta") and t.device == torch.device("cpu")


def _gloo_worker(rank, world):
    tr = CollectiveTransport()
    send = [torch.full((p + 1 + rank, 2), 10 * rank + p, dtype=torch.int64) for p in range(world)]
    got = tr.exchange(send, kind="ids")
    counts = tr.exchange_counts(torch.tensor([[p + rank] for p in range(world)]))
    return str(tr.wire_device), [g.tolist() for g in got], counts.view(-1).tolist()


def test_collective_transport_on_gloo_uses_host_memory():
    world = 2
    res = spawn_local(_gloo_worker, world)
    for r in range(world):
        wire, got, counts = res[r]
        assert wire == "cpu"
        for p in range(world):  # what rank p sent to r: rows r + 1 + p of value 10 p + r
            assert got[p] == [[10 * p + r] * 2] * (r + 1 + p)
        assert counts == [r + p for p in range(world)]


def test_host_aware_transport_reports_its_inner_backend_device():
    inner = _Fixed(torch.device("meta"))
    assert HostAwareTransport(inner, [0], 1).wire_device == torch.device("meta")
