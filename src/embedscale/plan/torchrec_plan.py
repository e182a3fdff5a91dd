"""TorchRec's own planner as a baseline strategy (OPER section 6.4 item 4), converted to our ``Plan``.

TorchRec's ``EmbeddingShardingPlanner`` sees tables, pooling factors (mean lookups per sample, from the
profile), the batch size and a TorchRec ``Topology`` of ``world_size`` ranks, ``local_world_size``
ranks per host and our link bandwidths. Its ``ShardingPlan`` is converted sharding type by sharding
type:

* ``table_wise``: the table is one partition owned by the shard's rank;
* ``row_wise`` / ``table_row_wise``: each shard's row range ``[offset, offset + size)`` is a partition
  owned by the shard's rank;
* ``data_parallel``: one partition held by every rank (owner: the table's index mod ``M``);
* ``column_wise`` / ``table_column_wise`` / grid: a column slice of every row cannot be expressed as row
  ownership; its rows are split into contiguous ranges proportional to each shard's columns (same
  memory per rank as TorchRec's shards) and the plan's ``meta["approximations"]`` says so.

TorchRec requires its compute device to be named; the planner runs with ``compute_device="cpu"``,
which here only selects TorchRec's cost constants (no tensor is allocated: the module is on ``meta``).
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np

from embedscale.errors import ConfigError
from embedscale.plan.cost import profile_samples, table_counts
from embedscale.plan.plan import Plan
from embedscale.plan.topology import OTHER_HOST, SAME_HOST, as_link_topology


class TorchRecUnavailable(ConfigError):
    """TorchRec is not installed or its planner failed; the message says exactly why."""


def plan_torchrec(tables, profile, topology, *, mode: str = "training", batch_size: int = 2048,
                  memory_per_rank: int | None = None) -> Plan:
    """Run TorchRec's planner and convert its plan (see module docstring).

    ``memory_per_rank`` (bytes) is TorchRec's DDR capacity; default: the topology's, else TorchRec's own.
    """
    t0 = time.perf_counter()
    try:
        import torch
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.planner.types import Topology as TRTopology
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
    except Exception as e:  # ImportError, or fbgemm failing to load its kernels
        raise TorchRecUnavailable(f"torchrec planner unavailable: {type(e).__name__}: {e}") from None
    topo = as_link_topology(topology)
    m = topo.world_size
    samples = profile_samples(profile)
    cls = topo.link_class()
    intra = float(topo.bandwidth[cls == SAME_HOST].min()) if (cls == SAME_HOST).any() else float(topo.bandwidth.max())
    inter = float(topo.bandwidth[cls == OTHER_HOST].min()) if (cls == OTHER_HOST).any() else intra
    cap = memory_per_rank if memory_per_rank is not None else (topo.memory_per_rank or None)
    configs, constraints = [], {}
    for s in tables:
        pf = float(np.asarray(table_counts(profile, s.name, s.num_rows), dtype=np.float64).sum()) / samples
        configs.append(EmbeddingBagConfig(name=s.name, embedding_dim=s.dim, num_embeddings=s.num_rows,
                                          feature_names=list(s.features)))
        constraints[s.name] = ParameterConstraints(pooling_factors=[max(pf, 1e-6)])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            level = logging.getLogger().level
            logging.getLogger().setLevel(logging.ERROR)
            try:
                ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
                tr_topo = TRTopology(
                    world_size=m, compute_device="cpu", local_world_size=topo.ranks_per_host,
                    ddr_cap=int(cap) if cap else None,
                    intra_host_bw=intra * 1e6, inter_host_bw=inter * 1e6,  # GB/s -> bytes/ms
                )
                planner = EmbeddingShardingPlanner(topology=tr_topo, batch_size=batch_size, constraints=constraints)
                sharding = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
            finally:
                logging.getLogger().setLevel(level)
    except Exception as e:
        raise TorchRecUnavailable(f"torchrec EmbeddingShardingPlanner failed on compute_device='cpu' with "
                                  f"world_size={m}: {type(e).__name__}: {e}") from None
    per_table = sharding.plan.get("") or next(iter(sharding.plan.values()))
    plan = convert_sharding(tables, m, {k: _shards_of(v, m) for k, v in per_table.items()}, mode, batch_size)
    plan.meta["plan_seconds"] = time.perf_counter() - t0
    plan.meta["torchrec_sharding_types"] = {k: v.sharding_type for k, v in per_table.items()}
    return plan


def _shards_of(ps, m: int) -> tuple[str, list[tuple[int, int, int, int, int]]]:
    """``(sharding type, [(row offset, rows, col offset, cols, rank)])`` of a TorchRec ParameterSharding."""
    out = []
    if ps.sharding_spec is not None:
        for sh in ps.sharding_spec.shards:
            rank = sh.placement.rank() if hasattr(sh.placement, "rank") else int(str(sh.placement).split(":")[1].split("/")[0])
            out.append((int(sh.shard_offsets[0]), int(sh.shard_sizes[0]), int(sh.shard_offsets[1]), int(sh.shard_sizes[1]), int(rank)))
    else:
        out = [(-1, -1, -1, -1, int(r)) for r in (ps.ranks or range(m))]
    return ps.sharding_type, out


def convert_sharding(tables, world_size: int, shards: dict, mode: str, batch_size: int) -> Plan:
    """Row ownership from TorchRec-style shards ``{table: (type, [(row_off, rows, col_off, cols, rank)])}``."""
    pt, ps, pe, po, rep = [], [], [], [], []
    approx = []
    for i, s in enumerate(tables):
        if s.name not in shards:
            raise ConfigError(f"torchrec plan has no entry for table {s.name!r}")
        kind, sh = shards[s.name]
        n = int(s.num_rows)
        if kind == "data_parallel":
            pt.append(i), ps.append(0), pe.append(n), po.append(i % world_size), rep.append(True)
            continue
        if kind in ("table_wise", "row_wise", "table_row_wise"):
            for off, rows, _, _, rank in sorted(sh):
                pt.append(i), ps.append(off), pe.append(off + rows), po.append(rank), rep.append(False)
            continue
        # column-wise (or grid): rows split in proportion to each shard's columns
        approx.append(f"{s.name}: {kind} converted to row ranges proportional to shard columns")
        cols = np.array([c for _, _, _, c, _ in sh], dtype=np.float64)
        bounds = np.round(np.concatenate([[0], np.cumsum(cols)]) / cols.sum() * n).astype(np.int64)
        for k, (_, _, _, _, rank) in enumerate(sh):
            if bounds[k + 1] > bounds[k]:
                pt.append(i), ps.append(int(bounds[k])), pe.append(int(bounds[k + 1])), po.append(rank), rep.append(False)
    pt, ps, pe, po, rep = map(np.asarray, (pt, ps, pe, po, rep))
    idx = np.lexsort((ps, pt))
    pt, ps, pe, po, rep = pt[idx], ps[idx], pe[idx], po[idx], rep[idx]
    holders = np.zeros((pt.size, world_size), dtype=bool)
    holders[np.arange(pt.size), po] = True
    holders[rep.astype(bool)] = True
    meta = {"strategy": "torchrec", "mode": mode, "batch_size": int(batch_size), "approximations": approx}
    return Plan(tables, world_size, [None] * len(tables), pt, ps, pe, po, holders, meta=meta)
