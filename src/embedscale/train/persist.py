"""One save and one restore for every Run: what a rank file holds beside the rows.

Every Run (single-process ``Trainer``, N-rank ``DistributedRun``, ``DMTRun``) lays out its own rows (whole
tables, rows by global id under a plan, row ranges of a tower group) and hands them to :func:`write_rank`, which
adds the rest of the one checkpoint format (``train.checkpoint``): the dense state and named optimizer state, the
losses and RNG, host tables, TT cores and their index reordering, managed tables' id mappings and the drift
monitor's rolling profile. :func:`restore_parts` reads them back, whatever world size wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from embedscale.device import HOST
from embedscale.errors import FormatError
from embedscale.train.checkpoint import MANAGED, ROLLING_PROFILE, load_managed, merged, rank0, write_rank_file
from embedscale.train.run import (RunState, dense_state, load_dense_state, load_optimizer_state, optimizer_groups,
                                  optimizer_state)


@dataclass
class CheckpointParts:
    """The parts of a Run a checkpoint holds beside its rows (``None``: the run has no such part).

    ``spread``: the dense parameters each rank writes (DMT: a tower group's first rank its towers' modules, rank
    0 the rest), given a rank; ``None``: rank 0 writes all of them. ``tt``: the TT tables (a ``ModuleDict``),
    ``mixed``: the module keeping their index reordering (EL-Rec IV), ``host``: the host parameter server's
    embedding and ``host_tables`` its tables' names."""

    model: nn.Module
    opt: torch.optim.Optimizer
    names: dict
    state: RunState
    host: nn.Module | None = None
    host_tables: list[str] = field(default_factory=list)
    tt: nn.Module | None = None
    mixed: nn.Module | None = None
    managed: object | None = None
    monitor: object | None = None
    spread: Callable[[int], Callable[[str], bool]] | None = None


def write_rank(parts: CheckpointParts, ckpt_dir: Path, rank: int, world: int, tables: dict, *, delta: bool = False,
               track: bool = False) -> None:
    """Write rank ``rank``'s file: its ``tables`` entries and the parts it keeps (``delta``: managed mappings as
    changed since their base, no rolling profile; ``track``: managed mappings start a new base)."""
    p = parts
    if p.monitor is not None:  # a re-plan check in flight: its verdict on disk before this (DriftMonitor.settle)
        p.monitor.settle()
    shard = {"rank": rank, "world_size": world, "tables": tables}
    if p.spread is not None:  # dense parameters spread over ranks: each writes those it keeps
        keep = p.spread(rank)
        shard.update({"dense": dense_state(p.model, keep), "optimizer": optimizer_state(p.opt, p.names, keep)})
    if rank == 0:
        if p.spread is None:
            shard.update({"dense": dense_state(p.model), "optimizer": optimizer_state(p.opt, p.names)})
        shard.update({"optimizer_groups": optimizer_groups(p.opt), "losses": list(p.state.losses),
                      "rng_torch": torch.get_rng_state()})
        if p.host is not None:  # replicated (or shared) on every rank: rank 0 writes them
            shard["host"] = {k: v.detach().to(HOST) for k, v in p.host.host_state().items()}
        if p.tt is not None:  # TT cores and their optimizer state: identical on every rank
            shard["tt"] = {k: v.detach().to(HOST) for k, v in p.tt.state_dict().items()}
        if p.mixed is not None and p.mixed.reorder_state():  # the maps the TT cores were trained under (EL-Rec IV)
            shard["reorder"] = p.mixed.reorder_state()
    if p.managed is not None:  # the mapping shards of managed tables this rank hosts
        shard[MANAGED] = p.managed.state_dict(delta=delta)  # a delta: what changed since its base
    if p.monitor is not None and not delta:  # this rank's rolling profile (train.replan)
        shard[ROLLING_PROFILE] = p.monitor.state_dict()
    write_rank_file(ckpt_dir, rank, shard)
    if track and p.managed is not None:
        p.managed.track()


def restore_parts(parts: CheckpointParts, ckpt_dir: Path, manifest: dict, shards: list[dict], *, rank: int = 0,
                  world: int = 1, inference: bool = False) -> None:
    """Load everything but the rows from ``shards`` (``checkpoint.read_shards``), then the run position
    (``inference``: no optimizer state)."""
    p, r0 = parts, rank0(shards)
    if p.host is not None:
        if not r0.get("host"):
            raise FormatError(f"{ckpt_dir}: no host tables in the checkpoint; this model has {p.host_tables}")
        p.host.load_host_state(r0["host"])
    if p.tt is not None:
        load_tt_state(p.tt, r0.get("tt"), ckpt_dir, with_optimizer=not inference)
    load_reorder(p.mixed, r0, ckpt_dir)
    load_dense_state(p.model, merged(shards, "dense"), ckpt_dir)
    if not inference:
        load_optimizer_state(p.opt, p.names, merged(shards, "optimizer"), r0["optimizer_groups"], ckpt_dir)
    if p.managed is not None:
        load_managed(p.managed, shards, ckpt_dir)
    if p.monitor is not None:
        p.monitor.restore(shards, rank, world)
    if "rng_torch" in r0:
        torch.set_rng_state(r0["rng_torch"])
    p.state.restore(manifest, r0.get("losses", []))


def load_tt_state(tt: nn.Module, state: dict | None, where, *, with_optimizer: bool = True) -> None:
    """Load TT cores (and, ``with_optimizer``, their optimizer state) into ``tt`` (a ``ModuleDict`` of TT tables);
    a table or core the checkpoint lacks, or another shape, is a ``FormatError`` naming it."""
    names = list(tt.keys())
    if not state:
        raise FormatError(f"{where}: no TT tables in the checkpoint; this model has {names}")
    missing = sorted({n for n in names if not any(k.startswith(f"{n}.") for k in state)})
    if missing:
        raise FormatError(f"{where}: the checkpoint has no cores for TT table(s) {missing}")
    def weight(k: str) -> bool:  # TT cores and a row-group table's exact hot rows (the rest: optimizer state)
        last = k.split(".")[-1]
        return last.startswith("core") or last == "hot_weight"

    with torch.no_grad():
        for k, dst in tt.state_dict().items():
            if k not in state:
                if weight(k):
                    raise FormatError(f"{where}: TT tensor {k!r} is missing")
                continue  # optimizer state of a checkpoint trained otherwise (or an inference model)
            if not with_optimizer and not weight(k):
                continue
            if tuple(state[k].shape) != tuple(dst.shape):
                raise FormatError(f"{where}: TT tensor {k!r} has shape {tuple(state[k].shape)}, this model's "
                                  f"{tuple(dst.shape)} (another rank or factorisation?)")
            dst.copy_(state[k])


def load_reorder(mixed: nn.Module | None, r0: dict, where) -> None:
    """The index reordering a checkpoint's rank-0 shard keeps (``"reorder"``: ``{table: map}``, EL-Rec IV) into
    ``mixed`` (the checkpoint's maps win: its TT cores were trained under them); a checkpoint with maps and a
    model without TT tables is a ``FormatError``."""
    maps = r0.get("reorder") or {}
    if mixed is None:
        if maps:
            raise FormatError(f"{where}: the checkpoint renames the ids of tables {sorted(maps)} (index "
                              "reordering), this model has no TT tables")
        return
    mixed.load_reorder_state(maps, where)
