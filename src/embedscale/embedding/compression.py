"""Which tables are stored as tensor-train tables, what that saves, and what it means for placement.

The policy (EL-Rec section VI-A, "Baseline"): tables with more than 1 million rows are decomposed into
TT tables of rank ``R`` (form ``TableForm("tt", tt_rank=R)``); the small tables stay uncompressed.
``plan.forms.decide_forms(tables, tt_min_rows=EL_REC_THRESHOLD_ROWS + 1, tt_rank=R)`` decides it (the one
place forms are decided; a config says ``compression: tt`` per table or ``model.tt_min_rows``).

**The placement contract for TT tables** (EL-Rec section VI-B, "DLRM training on multi-GPU platform"):
a TT table is small (a 10M x 16 table at rank 32 is under 2 MB of cores), so it is **replicated on
every rank and trained data-parallel**. A planner therefore

* gives TT tables no rows in its sharded plan (:func:`split_tables` separates them), never row- or
  table-wise shards them, and counts their :func:`table_bytes` (cores) on *every* rank's memory;
* leaves their lookups local: each rank looks up its own slice of the batch in its own replica (no
  embedding all-to-all for them);
* keeps replicas identical by summing the core gradients across ranks before the update: set
  ``TTEmbeddingBag.grad_sync`` (embedscale.embedding.tt) to an in-place all-reduce of the list of dense
  core gradients; the fused update then applies the summed gradient on every rank (the "gradient
  all-reduce in the backward phase" of section VI-B). Optimizer state is per replica and stays
  identical because the gradients are.

Where it is applied: ``model.tt_min_rows`` / ``compression: tt`` (config) or ``embedscale plan --tt-min-rows``
request it; ``plan.forms.decide_forms`` decides the forms (the TT size arithmetic, ``tt_shapes`` and
``table_bytes``, lives there too: the planner is numpy-only); ``plan.api.make_plan`` plans the others and
records the TT tables in ``plan.meta["replicated_tables"]`` and every form in ``plan.meta["forms"]``; ``train.distributed`` builds a
``MixedEmbedding`` whose uncompressed part is the plan's ``ShardedEmbedding`` and whose TT tables sync with
:func:`replica_grad_sync`.

:func:`compression_report` gives, per table, the bytes before (``num_rows * dim * bytes_per_value``) and
after (the TT cores in float32), and the totals: EL-Rec Table III's comparison (Kaggle 7.29x,
Terabyte 74.19x). Optimizer state is not counted on either side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from embedscale.comm.transport import all_reduce_sent
from embedscale.plan.forms import TT_BYTES_PER_VALUE, TableForm, replicated_tables_meta, table_bytes, tt_shapes
from embedscale.specs import TableSpec

# the TT size arithmetic lives in the (numpy-only) plan package; re-exported here for old callers
__all__ = ["EL_REC_THRESHOLD_ROWS", "TT_BYTES_PER_VALUE", "ReplicaGradSync", "compression_report", "replica_grad_sync",
           "replicated_tables_meta", "split_tables", "table_bytes", "tt_shapes"]

EL_REC_THRESHOLD_ROWS = 1_000_000


class ReplicaGradSync:
    """A ``TTEmbeddingBag.grad_sync`` for TT replicas on several ranks (EL-Rec section VI-B).

    Calling it sums a TT table's dense core gradients over the ranks of ``group`` (default: the world) in place,
    with one ``all_reduce`` of the cores flattened into one buffer; the fused update that follows then applies the
    same summed gradient on every rank, so the replicas stay identical. With a loss that is the sum over a rank's
    samples divided by the global batch size (``train.distributed``), the sum is exactly the single-process
    gradient of the global batch. ``stats["tt_grad_sync_bytes"]`` counts the bytes this rank sends
    (``comm.transport``'s convention: ring all_reduce, ``2 (W - 1) / W x`` the buffer).

    :meth:`start` is the same sum launched asynchronously: it returns a callable that waits for it and copies the
    sums back (``tt.GradSyncBucket`` starts the step's sum when the last TT table's backward has run and finishes
    it at the end of ``loss.backward()``, so the all-reduce overlaps the rest of the backward instead of stopping
    the rank until the other ranks reach it).
    """

    def __init__(self, group=None, stats: dict | None = None) -> None:
        self.group, self.stats = group, stats

    def start(self, grads: list) -> Callable[[], None]:
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def finish() -> None:
            work.wait()
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            if self.stats is not None:
                self.stats["tt_grad_sync_bytes"] = (self.stats.get("tt_grad_sync_bytes", 0)
                                                    + all_reduce_sent(flat, dist.get_world_size(self.group)))

        return finish

    def __call__(self, grads: list) -> None:
        self.start(grads)()


def replica_grad_sync(group=None, stats: dict | None = None) -> ReplicaGradSync:
    """The :class:`ReplicaGradSync` of ``group`` counting into ``stats``."""
    return ReplicaGradSync(group, stats)


def split_tables(tables: list[TableSpec],
                 forms: Mapping[str, TableForm]) -> tuple[list[TableSpec], list[TableSpec]]:
    """``(uncompressed, tt)`` by ``forms``: the tables a planner shards, and the TT tables it replicates on
    every rank."""
    return ([t for t in tables if forms[t.name].kind != "tt"], [t for t in tables if forms[t.name].kind == "tt"])


@dataclass
class TableCompression:
    name: str
    num_rows: int
    dim: int
    compression: str
    tt_rank: int | None
    row_shape: list[int] | None
    dim_shape: list[int] | None
    bytes_before: int
    bytes_after: int

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after


@dataclass
class CompressionReport:
    """Per-table and total embedding bytes before and after compression."""

    tables: list[TableCompression] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tables)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tables)

    @property
    def ratio(self) -> float:
        return self.bytes_before / self.bytes_after

    def to_dict(self) -> dict:
        return {"bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "ratio": self.ratio,
                "tables": [{**dataclasses.asdict(t), "ratio": t.ratio} for t in self.tables]}

    def to_markdown(self) -> str:
        lines = ["| table | rows | dim | stored as | bytes before | bytes after | ratio |",
                 "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
        for t in self.tables:
            how = (f"TT rank {t.tt_rank}, rows {'x'.join(map(str, t.row_shape))}, dim "
                   f"{'x'.join(map(str, t.dim_shape))}" if t.compression == "tt" else "rows")
            lines.append(f"| {t.name} | {t.num_rows:,} | {t.dim} | {how} | {_human(t.bytes_before)} | "
                         f"{_human(t.bytes_after)} | {t.ratio:.1f}x |")
        lines.append(f"| **total** | {sum(t.num_rows for t in self.tables):,} | | | **{_human(self.bytes_before)}** | "
                     f"**{_human(self.bytes_after)}** | **{self.ratio:.2f}x** |")
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def compression_report(tables: list[TableSpec], forms: Mapping[str, TableForm],
                       num_cores: int = 3) -> CompressionReport:
    """Bytes before and after, per table, for the tables in their ``forms`` (``plan.forms.decide_forms``)."""
    out = []
    for t in tables:
        f = forms[t.name]
        if f.kind == "tt":
            rows, dims, _ = tt_shapes(t, f.tt_rank, num_cores)
            out.append(TableCompression(t.name, t.num_rows, t.dim, "tt", f.tt_rank, rows, dims, t.memory_bytes,
                                        table_bytes(t, f, num_cores)))
        else:
            out.append(TableCompression(t.name, t.num_rows, t.dim, "none", None, None, None, t.memory_bytes,
                                        t.memory_bytes))
    return CompressionReport(out)
