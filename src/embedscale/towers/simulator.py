"""An analytic cluster simulator for DMT at 16-512 GPUs (DMT section 5.3, Figures 5, 10, 11).

It prices one training iteration of the flat model-parallel baseline, of the tower transform (SPTT, DMT
3.1) and of the tower transform with tower modules (DMT 3.2), under weak scaling (fixed local batch),
on the hardware of DMT Table 1, and reports the components and the speedups. Nothing here runs a model;
the figures are a model of the cluster, and every constant is an argument.

Hardware (DMT Table 1): peak FP throughput, scale-out bandwidth per GPU (RDMA NIC) and scale-up bandwidth
per GPU (NVLink, unidirectional). HBM bandwidth (for the lookups and the shuffles of steps c and e) is
not in Table 1; the manufacturers' figures are used (V100 SXM2 900 GB/s, A100 SXM 80 GB 2039 GB/s, H100
SXM 3350 GB/s).

Collective-efficiency model (DMT Figure 5: bus bandwidth of NCCL AlltoAll and AllReduce falls sharply
with the world size W at 8 GPUs per host). The figure's numbers are not in the text, so the model is a
stated assumption with two knobs, :class:`CollectiveModel`:

* the scale-out bandwidth reached by a collective over ``W`` ranks is ``bw_out * eff(W)`` with
  ``eff(W) = 1 / (1 + decay * log2(W / 2))`` for ``W >= 2`` (congestion and synchronisation grow with
  the number of endpoints);
* every peer message costs ``latency_us``: an all_to_all over ``W`` ranks pays ``(W - 1)`` of them
  (an AllReduce ``2 log2 W``).

Iteration time per GPU (local batch ``b``, ``F`` features of dim ``N``, ``c`` bytes per communicated
value (2: the strong baseline's quantized communication, DMT 5.1), pooled vector bytes ``V = b F N c``):

* compute: training FLOPs per sample (:func:`dense_flops`, forward + backward = 3 x forward) x ``b`` /
  (peak x ``mfu``), plus the embedding lookups (3 passes over the pooled rows at HBM bandwidth);
* flat: ids all_to_all, pooled all_to_all forward and backward over ``G`` ranks, dense AllReduce;
* SPTT: ids all_to_all over ``G``; forward and backward each: shuffle (step c), intra-host all_to_all
  (step d, scale-up links), shuffle (step e), peer all_to_all over ``G / 8`` ranks (step f); AllReduce;
* SPTT + TM: as SPTT with step f carrying ``V / CR``, the tower modules' FLOPs, the global AllReduce
  of the remaining dense parameters and an intra-host AllReduce of the tower modules' gradients.

No overlap of communication with compute is modelled (all communication is exposed), which favours
neither side: both pay it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from embedscale.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One GPU generation: DMT Table 1 plus HBM bandwidth (manufacturer)."""

    name: str
    peak_tflops: float
    scale_out_gbit_s: float  # per GPU
    scale_up_gbyte_s: float  # per GPU, unidirectional
    hbm_gbyte_s: float


HARDWARE = {
    "V100": Hardware("V100", 15.7, 100.0, 150.0, 900.0),
    "A100": Hardware("A100", 156.0, 200.0, 300.0, 2039.0),
    "H100": Hardware("H100", 989.0, 400.0, 450.0, 3350.0),
}


@dataclass(frozen=True)
class CollectiveModel:
    """Bus-bandwidth efficiency falling with world size (DMT Figure 5), and per-message latency."""

    decay: float = 0.2
    latency_us: float = 8.0

    def efficiency(self, world: int) -> float:
        return 1.0 / (1.0 + self.decay * math.log2(max(world, 2) / 2.0))

    def all_to_all(self, bytes_per_rank: float, world: int, ranks_per_host: int, hw: Hardware) -> float:
        """Seconds for an all_to_all where each rank holds ``bytes_per_rank`` spread evenly over all ranks."""
        if world <= 1:
            return 0.0
        L = min(ranks_per_host, world)
        cross = bytes_per_rank * (world - L) / world
        intra = bytes_per_rank * (L - 1) / world
        t_out = cross / (hw.scale_out_gbit_s / 8 * 1e9 * self.efficiency(world)) if cross else 0.0
        t_up = intra / (hw.scale_up_gbyte_s * 1e9)
        return max(t_out, t_up) + self.latency_us * 1e-6 * (world - 1)

    def peer_all_to_all(self, bytes_per_rank: float, world: int, hw: Hardware) -> float:
        """Every peer on another host (step f)."""
        if world <= 1:
            return 0.0
        cross = bytes_per_rank * (world - 1) / world
        return cross / (hw.scale_out_gbit_s / 8 * 1e9 * self.efficiency(world)) + self.latency_us * 1e-6 * (world - 1)

    def intra_all_to_all(self, bytes_per_rank: float, world: int, hw: Hardware) -> float:
        """Inside one host (step d)."""
        if world <= 1:
            return 0.0
        return bytes_per_rank * (world - 1) / world / (hw.scale_up_gbyte_s * 1e9) + self.latency_us * 1e-6 * (world - 1)

    def allreduce(self, nbytes: float, world: int, ranks_per_host: int, hw: Hardware) -> float:
        """Hierarchical ring: intra-host reduce-scatter/all-gather, cross-host ring of ``1/L`` shards."""
        if world <= 1:
            return 0.0
        L = min(ranks_per_host, world)
        H = world // L
        t_up = 2 * (L - 1) / L * nbytes / (hw.scale_up_gbyte_s * 1e9)
        t_out = 2 * (H - 1) / H * nbytes / L / (hw.scale_out_gbit_s / 8 * 1e9 * self.efficiency(world)) if H > 1 else 0.0
        return t_up + t_out + self.latency_us * 1e-6 * 2 * math.log2(world)


@dataclass(frozen=True)
class Workload:
    """The simulated model and batch (defaults: DMT's open-source DLRM on Criteo, section 5).

    ``arch`` is ``dlrm`` or ``dcn``. DLRM defaults (TorchRec's Criteo DLRM: bottom 512-256-128, top
    1024-1024-512-256-1, N = 128) give 14.75 MFLOPs per sample to train, DMT Table 3's 14.74. The DMT
    side uses DMT 5.2.2's tower modules: DLRM ``c = 1, p = 0, D = 64`` (CR 2), DCN ``D = 64``.
    """

    arch: str = "dlrm"
    num_features: int = 26
    embedding_dim: int = 128
    num_dense: int = 13
    local_batch: int = 16384
    pooling_factor: float = 1.0
    bottom_mlp: tuple[int, ...] = (512, 256)
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256)
    cross_layers: int = 3
    cross_low_rank: int = 512
    tower_dim: int = 64
    c: int = 1
    p: int = 0
    tower_cross_layers: int = 1
    tower_cross_low_rank: int = 0
    id_bytes: int = 8
    comm_bytes: int = 2  # per communicated embedding value (quantized comm of the strong baseline)
    grad_bytes: int = 2  # per dense gradient value in the AllReduce
    mfu: float = 0.35  # fraction of peak the dense compute reaches


def _mlp(inp: int, sizes: Sequence[int]) -> tuple[int, int]:
    """(MACs, parameters) of a stack of linear layers."""
    macs = params = 0
    for s in sizes:
        macs += inp * s
        params += inp * s + s
        inp = s
    return macs, params


def dense_flops(w: Workload, towers: int = 0) -> dict:
    """Training FLOPs per sample (3 x forward, 2 per MAC) and dense parameters, flat (``towers = 0``) or
    DMT with ``towers`` towers of equal size; ``tower_params`` are the tower modules' parameters."""
    F, N, D = w.num_features, w.embedding_dim, w.tower_dim
    tower_macs = tower_params = 0
    if w.arch == "dlrm":
        if towers:
            bm, bp = _mlp(w.num_dense, list(w.bottom_mlp) + [D])
            V = w.c * F + w.p * towers
            tower_macs = F * N * w.c * D + F * N * w.p * D
            tower_params = towers * ((N * w.c * D + w.c * D) if w.c else 0) + ((F * N * w.p * D + towers * w.p * D)
                                                                              if w.p else 0)
            inter = (V + 1) ** 2 * D
            tm, tp = _mlp(D + V * (V + 1) // 2, list(w.top_mlp) + [1])
        else:
            bm, bp = _mlp(w.num_dense, list(w.bottom_mlp) + [N])
            inter = (F + 1) ** 2 * N
            tm, tp = _mlp(N + F * (F + 1) // 2, list(w.top_mlp) + [1])
        macs = bm + inter + tm + tower_macs
        params = bp + tp
    elif w.arch == "dcn":
        bm, bp = _mlp(w.num_dense, list(w.bottom_mlp) + [N])

        def cross(d: int, layers: int, r: int) -> tuple[int, int]:
            per = 2 * d * r if r else d * d
            return layers * (per + 2 * d), layers * (per + d)

        if towers:
            Ft = F / towers
            cm, cp = cross(int(Ft * N), w.tower_cross_layers, w.tower_cross_low_rank)
            tower_macs = int(towers * (cm + Ft * N * Ft * D))
            tower_params = int(towers * (cp + Ft * N * Ft * D + Ft * D))
            d = N + F * D
        else:
            d = N + F * N
        xm, xp = cross(d, w.cross_layers, w.cross_low_rank)
        tm, tp = _mlp(d, list(w.top_mlp) + [1])
        macs = bm + xm + tm + tower_macs
        params = bp + xp + tp
    else:
        raise ConfigError(f"simulator: arch {w.arch!r} is not dlrm or dcn")
    return {"train_flops": 6.0 * macs, "dense_params": params, "tower_params": tower_params,
            "tower_train_flops": 6.0 * tower_macs}


def compression_ratio(w: Workload) -> float:
    """CR of the workload's tower modules (input values over output values per sample)."""
    if w.arch == "dlrm":
        return w.embedding_dim / (w.c * w.tower_dim + 0.0) if not w.p else \
            w.num_features * w.embedding_dim / (w.tower_dim * (w.c * w.num_features + w.p))
    return w.embedding_dim / w.tower_dim


def simulate(gpus: int, hardware: str | Hardware = "A100", *, ranks_per_host: int = 8, workload: Workload | None = None,
             collectives: CollectiveModel | None = None) -> dict:
    """One iteration of flat, SPTT and SPTT + TM at ``gpus`` GPUs; seconds per component and speedups.

    Args:
        gpus: G (a multiple of ``ranks_per_host``).
        hardware: a name of :data:`HARDWARE` or a :class:`Hardware`.
        ranks_per_host: L (8 in DMT's clusters).
        workload: the model and batch (default :class:`Workload`).
        collectives: the collective-efficiency model (default :class:`CollectiveModel`).

    Returns:
        ``{"gpus", "hosts", "hardware", "flat": {...}, "sptt": {...}, "dmt": {...}, "speedup_sptt",
        "speedup_dmt", "speedup_tm_over_sptt", "throughput": {name: samples/s}}``; each of flat/sptt/dmt
        maps components (``compute``, ``lookup``, ``ids``, ``embedding_comm``, ``shuffle``, ``allreduce``)
        and ``total`` to seconds.
    """
    w = workload or Workload()
    cm = collectives or CollectiveModel()
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    if gpus <= 0 or gpus % ranks_per_host:
        raise ConfigError(f"simulator: {gpus} GPUs is not a positive multiple of {ranks_per_host} per host")
    G, L = gpus, ranks_per_host
    H = G // L
    b, F, N = w.local_batch, w.num_features, w.embedding_dim
    V = b * F * N * w.comm_bytes  # pooled vectors of this rank's samples (= of its tables' global batch)
    ids = b * F * w.pooling_factor * w.id_bytes
    peak = hw.peak_tflops * 1e12 * w.mfu
    lookup = 3 * b * F * w.pooling_factor * N * 4 / (hw.hbm_gbyte_s * 1e9)
    shuffle = 2 * V / (hw.hbm_gbyte_s * 1e9)  # read + write of the pooled rows
    flat_f = dense_flops(w, 0)
    dmt_f = dense_flops(w, H)
    CR = compression_ratio(w)
    t_ids = cm.all_to_all(ids, G, L, hw)

    flat = {"compute": flat_f["train_flops"] * b / peak, "lookup": lookup, "ids": t_ids,
            "embedding_comm": 2 * cm.all_to_all(V, G, L, hw), "shuffle": 0.0,
            "allreduce": cm.allreduce(flat_f["dense_params"] * w.grad_bytes, G, L, hw)}
    step_df = cm.intra_all_to_all(V, L, hw) + cm.peer_all_to_all(V, H, hw)
    sptt = {"compute": flat["compute"], "lookup": lookup, "ids": t_ids, "embedding_comm": 2 * step_df,
            "shuffle": 2 * 2 * shuffle, "allreduce": flat["allreduce"]}
    dmt = {"compute": dmt_f["train_flops"] * b / peak, "lookup": lookup, "ids": t_ids,
           "embedding_comm": 2 * (cm.intra_all_to_all(V, L, hw) + cm.peer_all_to_all(V / CR, H, hw)),
           "shuffle": 2 * 2 * shuffle,
           "allreduce": cm.allreduce(dmt_f["dense_params"] * w.grad_bytes, G, L, hw)
           + cm.allreduce(dmt_f["tower_params"] * w.grad_bytes, L, L, hw)}
    for d in (flat, sptt, dmt):
        d["total"] = sum(d.values())
    return {
        "gpus": G, "hosts": H, "hardware": hw.name, "arch": w.arch, "compression_ratio": CR,
        "flops_per_sample": {"flat": flat_f["train_flops"], "dmt": dmt_f["train_flops"]},
        "a2a_efficiency": {"world": cm.efficiency(G), "peer": cm.efficiency(H)},
        "flat": flat, "sptt": sptt, "dmt": dmt,
        "speedup_sptt": flat["total"] / sptt["total"], "speedup_dmt": flat["total"] / dmt["total"],
        "speedup_tm_over_sptt": sptt["total"] / dmt["total"],
        "throughput": {k: G * b / d["total"] for k, d in (("flat", flat), ("sptt", sptt), ("dmt", dmt))},
    }


def sweep(gpus: Sequence[int] = (16, 32, 64, 128, 256, 512), hardware: Sequence[str] = ("V100", "A100", "H100"),
          archs: Sequence[str] = ("dlrm", "dcn"), *, ranks_per_host: int = 8, workload: Workload | None = None,
          collectives: CollectiveModel | None = None) -> list[dict]:
    """:func:`simulate` over scales, hardware and archs (DMT Figure 10's grid; V100 clusters stop at 16
    hosts as in the paper's footnote 2)."""
    base = workload or Workload()
    out = []
    for arch in archs:
        w = replace(base, arch=arch)
        for hw in hardware:
            for g in gpus:
                if hw == "V100" and g // ranks_per_host > 16:
                    continue
                out.append(simulate(g, hw, ranks_per_host=ranks_per_host, workload=w, collectives=collectives))
    return out


def describe(workload: Workload | None = None, collectives: CollectiveModel | None = None) -> dict:
    """The simulator's settings, for reports."""
    return {"workload": asdict(workload or Workload()), "collectives": asdict(collectives or CollectiveModel()),
            "hardware": {k: asdict(v) for k, v in HARDWARE.items()}}
