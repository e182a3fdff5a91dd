"""Communication volume over time per rank: the instrument behind the PGAS paper's Fig. 7 and Fig. 10.

The paper (section IV-A-2-b) adds, with every one-sided write, the bytes written to a counter that is
sampled every hundred GPU cycles, and plots the counter (in units of 256 bytes) against time for the
PGAS fused retrieval; for the all_to_all baseline it draws the total volume linearly interpolated over
the communication phase (dashed). ``Timeline`` is that counter on the host: every one-sided write or
get of a ``PgasTransport`` / ``PgasShardedEmbedding`` appends ``(time, bytes, peer, kind)`` to
preallocated arrays (no allocation, no lock: one writer per rank), and ``plot_timeline`` draws the
cumulative volume of every rank, with the baseline phases as dashed lines, into a PNG.

Timestamps are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux), one clock for every process of a
host, so the ranks' curves share the time axis.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

KINDS = ("data", "ids", "rows", "pooled", "grads")


class Timeline:
    """Bytes one rank moves by one-sided writes (and gets), with the time of each.

    Args:
        capacity: events kept; later events are dropped and counted in ``dropped``.

    ``record(nbytes, peer, kind)`` is called by the transport right after each write into a peer's
    segment; ``events()`` returns the arrays recorded so far (times in ns, relative to nothing: subtract
    a common start to plot several ranks).
    """

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = int(capacity)
        self.t_ns = np.zeros(self.capacity, dtype=np.int64)
        self.nbytes = np.zeros(self.capacity, dtype=np.int64)
        self.peer = np.zeros(self.capacity, dtype=np.int32)
        self.kind = np.zeros(self.capacity, dtype=np.int8)
        self.n = 0
        self.dropped = 0
        self.marks: list[tuple[str, int]] = []

    def record(self, nbytes: int, peer: int, kind: str = "data") -> None:
        if self.n >= self.capacity:
            self.dropped += 1
            return
        i = self.n
        self.t_ns[i] = time.perf_counter_ns()
        self.nbytes[i] = nbytes
        self.peer[i] = peer
        self.kind[i] = KINDS.index(kind) if kind in KINDS else 0
        self.n = i + 1

    def mark(self, label: str) -> None:
        """A named instant (e.g. the start of a forward) drawn as a vertical tick."""
        self.marks.append((label, time.perf_counter_ns()))

    def reset(self) -> None:
        self.n = 0
        self.dropped = 0
        self.marks = []

    def events(self) -> dict:
        """``{"t_ns", "nbytes", "peer", "kind"}`` arrays of the recorded events, plus ``marks``."""
        n = self.n
        return {"t_ns": self.t_ns[:n].copy(), "nbytes": self.nbytes[:n].copy(), "peer": self.peer[:n].copy(),
                "kind": self.kind[:n].copy(), "marks": list(self.marks), "dropped": self.dropped}

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes[: self.n].sum())


def plot_timeline(per_rank: list[dict], path: str | Path, *, baseline: list[dict] | None = None,
                  title: str = "communication volume over time", unit: int = 256) -> Path:
    """Cumulative bytes written per rank against time, as a PNG (PGAS paper Fig. 7).

    Args:
        per_rank: one ``Timeline.events()`` dict per rank (``t_ns``, ``nbytes``); an optional ``t0_ns``
            key sets the time origin of that rank (default: the earliest event or mark of all ranks).
        path: the PNG to write.
        baseline: optional, one dict per rank ``{"start_ns", "end_ns", "bytes"}`` (optional ``t0_ns``:
            its time origin): the all_to_all baseline's communication phase, drawn dashed as the paper
            does (total volume linearly interpolated over the phase).
        unit: the y unit in bytes (the paper counts in units of 256 bytes).

    Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    starts = [int(e["t_ns"].min()) for e in per_rank if len(e["t_ns"])]
    starts += [m[1] for e in per_rank for m in e.get("marks", [])]
    if baseline:
        starts += [int(b["start_ns"]) for b in baseline]
    t0 = min(starts) if starts else 0
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, e in enumerate(per_rank):
        c = colors[r % len(colors)]
        origin = int(e.get("t0_ns", t0))
        t = (np.asarray(e["t_ns"], dtype=np.int64) - origin) / 1e6
        v = np.cumsum(np.asarray(e["nbytes"], dtype=np.int64)) / unit
        if t.size:
            ax.step(np.concatenate([[0.0], t]), np.concatenate([[0.0], v]), where="post", color=c,
                    label=f"PGAS fused, rank {r}")
        for label, tm in e.get("marks", []):
            ax.axvline((tm - origin) / 1e6, color=c, lw=0.5, alpha=0.4)
    for r, b in enumerate(baseline or []):
        c = colors[r % len(colors)]
        o = int(b.get("t0_ns", t0))
        s, e_, tot = (int(b["start_ns"]) - o) / 1e6, (int(b["end_ns"]) - o) / 1e6, b["bytes"] / unit
        ax.plot([0.0, s, e_], [0.0, 0.0, tot], ls="--", color=c, alpha=0.8, label=f"all_to_all baseline, rank {r}")
    ax.set_xlabel("time since the start of the forward (ms)" if any("t0_ns" in e for e in per_rank) else "time (ms)")
    ax.set_ylabel(f"bytes written to peers (x{unit} B)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
