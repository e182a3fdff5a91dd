"""One checkpoint format for every run: ``checkpoints/step-N/`` = ``manifest.json`` + ``rank-XXXXX.pt`` per rank.

Every run (one process, N ranks under any plan, TT/host mixtures, pipelined host tables, DMT towers) writes
the same directory: each rank a file with the embedding rows it holds, *by table name and row id* (so a
checkpoint restores onto any world size, plan or tower sharding), and the dense state it is responsible
for; rank 0 writes ``manifest.json`` last, after every rank file is complete. All of it goes into a temporary
directory first (``checkpoints/.step-N.tmp``, which no reader looks at), renamed to ``step-N`` only once the
manifest is in it (:func:`publish`): a ``step-N`` is always complete, and a write that fails (a full disk) or is
killed leaves nothing a reader could take for a checkpoint. A failed write is one error on every rank
(:func:`agree`: the first failing rank names the file and the cause, :class:`~embedscale.errors.CheckpointWriteError`;
the others exit quietly) and the run's earlier checkpoints stay as they were. One process is a world of one.

``checkpoints/best`` (a relative symbolic link, replaced atomically by rank 0 once the checkpoint it names
is complete) points at the step directory of the best evaluation so far (``train.loop``: the monitored eval
metric; its figures are in that manifest's ``early_stopping``); the latest step directory is the last
model. Being a checkpoint directory itself, it goes wherever one is asked for (``embedscale evaluate``,
``infer``); ``resolve_checkpoint`` turns it into the step directory.

A rank file holds only tensors, numbers, strings, lists and dicts (read back with
``torch.load(..., weights_only=True)``, never pickle):

- ``tables``: ``{table: {"rows": int64 [k], "weight": [k, dim], "momentum": [k] (row-wise Adagrad)}}``, the
  rows this rank stores (every row of every row-stored table is in exactly one rank's file);
- ``dense``: model state outside the embedding tables (module name -> tensor), in one or more rank files
  (DMT: tower modules in the first rank of each tower group);
- ``optimizer``: the dense optimizer's state *by parameter name* (positions differ between a sharded and a
  single-process model), and on rank 0 ``optimizer_groups`` (learning rates, warmup base rates);
- rank 0 only: ``losses`` (every step's loss), ``rng_torch``, ``host`` (host parameter-server tables:
  ``<table>.weight`` / ``.momentum``), ``tt`` (TT cores and their optimizer state: every rank's copy is
  the same);
- ``managed`` (every rank): the mapping shards of the managed tables this rank hosts (``<table>.config``,
  ``<table>.step``, ``<table>.<shard>.<key>`` tensors of ``ManagedIdTable.state_dict``; in a delta only what
  changed since its base, ``ManagedIdTable.delta_state_dict``, laid over the base's on reading,
  ``embedding.managed.apply_delta``). The rank files' entries together hold every shard once; a restore merges them and each rank takes the
  shards it hosts then (any world size).

The manifest holds the run position (step, epoch, batch_in_epoch, samples, and the early-stopping state:
best step and value, evaluations without improvement, stopped), ``kind`` (``plan``: flat
model; ``dmt``: tower model), the row-stored tables and their rows, the optimizers, the resolved config
(``config_yaml``), the shard file names and ``id`` (random, new at every write: a delta names its base by it).

Delta checkpoints (``train.checkpoint_full_every`` M > 0. The loop writes a *full*
checkpoint (the above) when it has none to build on in this process or when the step enters a new multiple
of M (``step // M`` changed since the last full one), a *delta* otherwise. A delta is the same directory
(manifest version :data:`DELTA_VERSION`, ``delta: {base, base_step, base_id}``) whose rank files hold, of
the row-stored tables, only the rows updated since its base (the last full checkpoint, a sibling step
directory) with their row-wise optimizer state, and everything else whole (dense state and optimizer,
host tables, TT cores, losses, RNG: the run position). Deltas are cumulative, never chained: restoring
one reads its base and overlays the delta's rows (:func:`read_shards`), so it is exact, re-shards onto any
world size like a full checkpoint, and needs only its base. A delta's row ids are stored as int32, or as a
bitmap over the table (``rows_bitmap``, ``np.packbits``) when that is smaller. A missing, unreadable or
rewritten base (its ``id`` differs from ``base_id``) is a ``FormatError`` naming both directories; the loop
never removes a base a delta names (:func:`bases_in_use`). The rows are those the fused sparse optimizers
updated (``LocalEmbeddingBags`` / ``ShardedEmbedding.track_touched``: one bool per row, set by the update).
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedscale.device import HOST
from embedscale.embedding.managed import apply_delta
from embedscale.errors import CheckpointWriteError, FormatError
from embedscale.io import atomic_open, read_json
from embedscale.storage import ObjectPath, location, remove_tree, write_bytes
from embedscale.train.ckpt_rows import (INDEX, SIZES, RowReader, collect_index, index_name, read_shard, read_spread,
                                        write_rank_index)

FORMAT = "embedscale.checkpoint"
VERSION = 2
DELTA_VERSION = 3  # a delta checkpoint (rows touched since its base): readers before it reject it by version
MANIFEST = "manifest.json"
BEST = "best"  # checkpoints/best: a symbolic link to the best evaluation's step directory
_STEP = re.compile(r"^step-(\d+)$")


# -- paths ------------------------------------------------------------------------------------------
def step_dir(run_dir: str | Path | ObjectPath, step: int) -> Path | ObjectPath:
    """``<run dir>/checkpoints/step-NNNNNNNN`` (``run_dir``: a run directory or where its checkpoints go,
    ``train.checkpoint_dir``: a local path or an fsspec URI)."""
    return location(run_dir) / "checkpoints" / f"step-{step:08d}"


def checkpoint_home(run_dir: str | Path, checkpoint_dir: str = "") -> Path | ObjectPath:
    """Where a run's ``checkpoints/`` go: ``train.checkpoint_dir`` (a local path or any fsspec URI,
    ``embedscale.storage``) when it is set, else the run directory."""
    return location(checkpoint_dir) if checkpoint_dir else Path(run_dir)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def temp_dir(ckpt_dir: str | Path | ObjectPath) -> Path | ObjectPath:
    """Where ``ckpt_dir`` (``checkpoints/step-N``) is written until it is complete: ``checkpoints/.step-N.tmp``;
    on an object store (no rename) ``ckpt_dir`` itself, which no reader takes before its manifest is there."""
    ckpt_dir = location(ckpt_dir)
    if isinstance(ckpt_dir, ObjectPath):
        return ckpt_dir
    return ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")


def is_temp(path: str | Path) -> bool:
    """A checkpoint being written (or whose write was interrupted): never a checkpoint to a reader."""
    name = location(path).name
    return name.startswith(".") and name.endswith(".tmp")


def is_checkpoint(path: str | Path) -> bool:
    """A complete checkpoint: a directory whose manifest has been written (a temporary directory never is)."""
    return not is_temp(path) and (location(path) / MANIFEST).is_file()


def latest_checkpoint(path: str | Path) -> Path | None:
    """The complete checkpoint with the highest step of a run directory (or of its ``checkpoints/``);
    ``None`` if there is none. Directories without a manifest (interrupted writes) are skipped."""
    d = location(path)
    if isinstance(d, ObjectPath):
        d.check()  # a missing bucket or an endpoint that does not answer: a named error now
    if (d / "checkpoints").is_dir():
        d = d / "checkpoints"
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP.match(p.name)) and is_checkpoint(p)]
    return max(found)[1] if found else None


def best_pointer(run_dir: str | Path | ObjectPath) -> Path | ObjectPath:
    """``<run dir>/checkpoints/best``."""
    return location(run_dir) / "checkpoints" / BEST


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The step directory ``checkpoints/best`` points at (``run_dir`` a run directory or its ``checkpoints/``),
    or ``None`` without a pointer; a pointer to an incomplete checkpoint is a ``FormatError``."""
    p = location(run_dir)
    pointer = p / BEST if p.name == "checkpoints" else best_pointer(p)
    if isinstance(pointer, ObjectPath):  # no links on an object store: an object holding the step's name
        if not pointer.is_file():
            return None
        target = pointer.parent / pointer.read_text().strip()
    elif not pointer.is_symlink():
        return None
    else:
        target = pointer.parent / os.readlink(pointer)
    if not is_checkpoint(target):
        raise FormatError(f"{pointer}: points at {target}, which is not a complete checkpoint")
    return target


def write_best(run_dir: str | Path, step: int) -> Path:
    """Point ``checkpoints/best`` at ``checkpoints/step-N`` (complete already): a relative symbolic link (the run
    directory can move), made under a temporary name and renamed over the old one, so a reader sees the old
    best or the new one, never neither."""
    pointer = best_pointer(run_dir)
    if isinstance(pointer, ObjectPath):  # one PUT of the step's name: the old pointer or the new one
        pointer.write_text(step_dir(run_dir, step).name)
        return pointer
    tmp = pointer.with_name(f".{BEST}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(step_dir(run_dir, step).name, tmp)
    if pointer.is_dir() and not pointer.is_symlink():
        # a copy of the run made by a tool that follows links (shutil.copytree, cp -L, rsync -L) holds the
        # best checkpoint's files here instead of the link: a duplicate of a step directory, replaced
        shutil.rmtree(pointer)
    os.replace(tmp, pointer)
    return pointer


def resolve_checkpoint(path: str | Path, *, best: bool = False) -> Path:
    """A checkpoint directory from a checkpoint directory (``checkpoints/best`` included: the step directory
    it points at), or a run directory (its latest checkpoint; with ``best``, the one ``checkpoints/best``
    points at)."""
    p = location(path)
    if p.name == BEST and (p.is_symlink() or (isinstance(p, ObjectPath) and p.is_file())):
        found = best_checkpoint(p.parent)
        assert found is not None
        return found
    if is_checkpoint(p):
        return p
    if p.is_dir():
        found = best_checkpoint(p) if best else latest_checkpoint(p)
        if found is not None:
            return found
        if best:
            raise FormatError(f"{p}: no checkpoints/{BEST} (the run had no evaluation, or kept no best checkpoint)")
        raise FormatError(f"{p}: neither a checkpoint (no {MANIFEST}) nor a run directory with a complete "
                          "checkpoint under checkpoints/step-N/")
    raise FormatError(f"{p}: not a checkpoint directory (a run's checkpoints/step-N/, checkpoints/{BEST} or a run "
                      "directory)")


# -- reading ----------------------------------------------------------------------------------------
def read_manifest(ckpt_dir: str | Path) -> dict:
    """The manifest of a complete checkpoint; another format or version is a ``FormatError``."""
    ckpt_dir = location(ckpt_dir)
    if not is_checkpoint(ckpt_dir):
        raise FormatError(f"{ckpt_dir}: not a complete checkpoint (no {MANIFEST})")
    m = read_json(ckpt_dir / MANIFEST, "checkpoint manifest")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise FormatError(f"{ckpt_dir / MANIFEST}: not an embedscale checkpoint (format {m.get('format')!r})"
                          if isinstance(m, dict) else f"{ckpt_dir / MANIFEST}: not an embedscale checkpoint")
    if m.get("version") not in (VERSION, DELTA_VERSION) or (m.get("version") == DELTA_VERSION) != ("delta" in m):
        raise FormatError(f"{ckpt_dir / MANIFEST}: checkpoint version {m.get('version')} is not {VERSION} "
                          f"(full) or {DELTA_VERSION} (delta)")
    return m


def is_delta(manifest: dict) -> bool:
    """Whether a manifest is a delta checkpoint's (rows touched since its base only)."""
    return "delta" in manifest


def delta_base(ckpt_dir: str | Path, manifest: dict) -> Path:
    """The full checkpoint a delta was written against (a sibling step directory), checked: missing,
    incomplete, itself a delta, or rewritten since (another ``id``) is a ``FormatError`` naming both."""
    ckpt_dir = location(ckpt_dir)
    d = manifest["delta"]
    base = ckpt_dir.parent / str(d["base"])
    what = f"delta checkpoint {ckpt_dir} (step {manifest.get('step')})"
    if not base.is_dir():
        raise FormatError(f"{what}: its base {base} is missing (a delta holds only the rows touched since its "
                          "base full checkpoint; both are needed)")
    try:
        bm = read_manifest(base)
    except FormatError as e:
        raise FormatError(f"{what}: its base is damaged: {e}") from None
    if is_delta(bm):
        raise FormatError(f"{what}: its base {base} is itself a delta checkpoint")
    if bm.get("id") != d.get("base_id") or bm.get("step") != d.get("base_step"):
        raise FormatError(f"{what}: its base {base} was rewritten since (step {bm.get('step')}, id {bm.get('id')}; "
                          f"the delta was written against step {d.get('base_step')}, id {d.get('base_id')})")
    if bm.get("tables") != manifest.get("tables") or bm.get("table_rows") != manifest.get("table_rows"):
        raise FormatError(f"{what}: its base {base} has other tables ({bm.get('tables')} / {bm.get('table_rows')})")
    return base


def bases_in_use(run_dir: str | Path) -> set[str]:
    """Names of the step directories that a complete delta checkpoint of the run names as its base (a
    directory a retention rule must keep). ``run_dir``: a run directory or its ``checkpoints/``."""
    d = location(run_dir)
    if d.name != "checkpoints":
        d = d / "checkpoints"
    out: set[str] = set()
    if not d.is_dir():
        return out
    for p in d.iterdir():
        if _STEP.match(p.name) and is_checkpoint(p):
            try:
                m = json.loads((p / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(m, dict) and isinstance(m.get("delta"), dict):
                out.add(str(m["delta"].get("base")))
    return out


def read_shards(ckpt_dir: str | Path | ObjectPath, manifest: dict, tables: bool = True) -> list[dict]:
    """The rank files of a checkpoint. A delta's come with its base's rows under them: the base's rank files
    (their table rows the delta does not hold, nothing else; ranks ``-1, -2, ...``) then the delta's own, so
    every reader (:func:`table_pieces`, :func:`assemble_table`, :func:`merged`, :func:`rank0`) sees the
    state at the delta's step, each row once. ``tables=False`` (a full checkpoint with a row index): the
    tables' rows may be left out (a remote rank file is then read without them; the caller reads the rows it
    needs with ``ckpt_rows.RowReader``)."""
    index = manifest.get(INDEX) if not tables and not is_delta(manifest) else None
    shards = [read_shard(location(ckpt_dir) / name, (index or {}).get(name)) for name in manifest["shards"]]
    if not is_delta(manifest):
        return shards
    return _overlay(ckpt_dir, manifest, shards)


def entry_rows(e: dict) -> np.ndarray:
    """The row ids (int64) of a rank file's table entry: ``rows`` (int64; int32 in a delta) or a delta's
    ``rows_bitmap`` over the table's ``bitmap_rows`` rows."""
    if "rows_bitmap" in e:
        return np.flatnonzero(np.unpackbits(e["rows_bitmap"].numpy(), count=int(e["bitmap_rows"])))
    return e["rows"].numpy().astype(np.int64, copy=False)


def _overlay(ckpt_dir: str | Path, manifest: dict, delta: list[dict], base_shards: list[dict] | None = None
             ) -> list[dict]:
    """The delta's rank files over its base's (:func:`read_shards`); ``base_shards``: the base's rank files
    already read (without their tables: :func:`read_rows`)."""
    if base_shards is None:
        base = delta_base(ckpt_dir, manifest)
        try:
            base_shards = [read_shard(base / name) for name in read_manifest(base)["shards"]]
        except FormatError as e:
            raise FormatError(f"delta checkpoint {ckpt_dir}: its base is damaged: {e}") from None
    fresh: dict[str, np.ndarray] = {}
    for name, n in zip(manifest["tables"], manifest["table_rows"]):
        mask = np.zeros(int(n), dtype=bool)
        for sh in delta:
            e = (sh.get("tables") or {}).get(name)
            if e is None:
                continue
            rows = entry_rows(e)
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                raise FormatError(f"{ckpt_dir}: table {name!r} has a saved row {int(rows.max())} outside [0, {n})")
            mask[rows] = True
            e["rows"] = torch.from_numpy(rows)
            e.pop("rows_bitmap", None)
            e.pop("bitmap_rows", None)
        fresh[name] = mask
    out = []
    for i, sh in enumerate(base_shards):
        tables = {}
        for name, e in (sh.get("tables") or {}).items():
            if name not in fresh:
                continue
            rows = entry_rows(e)
            keep = ~fresh[name][rows]
            if keep.all():
                tables[name] = e
                continue
            k = torch.from_numpy(np.flatnonzero(keep))
            tables[name] = {"rows": torch.from_numpy(rows[keep]), "weight": e["weight"][k],
                            **({"momentum": e["momentum"][k]} if "momentum" in e else {})}
        base_rank = {"rank": -1 - i, "tables": tables}
        if sh.get(ROLLING_PROFILE) is not None:  # deltas carry none: the base's, for train.replan to fall back on
            base_rank[ROLLING_PROFILE] = sh[ROLLING_PROFILE]
        out.append(base_rank)
    changed = merged(delta, MANAGED)
    if changed:  # the id mappings that changed, laid over the base's: the whole mapping at the delta's step
        try:
            whole = apply_delta(merged(base_shards, MANAGED), changed)
        except FormatError as e:
            raise FormatError(f"delta checkpoint {ckpt_dir}: {e}") from None
        for sh in delta:
            sh.pop(MANAGED, None)
        delta[0][MANAGED] = whole
    return out + delta


def read_rows(ckpt_dir: str | Path | ObjectPath, manifest: dict, wanted: dict[str, np.ndarray], group=None
              ) -> tuple[list[dict], dict, int] | None:
    """A restore reading only the rows ``wanted`` (``{table: row ids}``, a rank's share): ``(rank files without
    their tables' rows, {table: (weight, momentum)} of the wanted rows in their order, bytes of rows read)``.
    A full checkpoint: ``ckpt_rows.RowReader.restore``. A delta: its own rank files read once over the ranks of
    ``group`` (each rank 1/N, all-gathered: ``ckpt_rows.read_spread``), the wanted rows it holds taken from them,
    only the others read from its base (``RowReader``), the base's other bytes spread as well; no row of the base
    that the delta replaces is read. ``None`` when the checkpoint (a delta: its base) has no row index: the
    caller reads the rank files (:func:`read_shards`); ``None`` as well without a group of several ranks: one
    process holds every row, its share is every rank file, read whole (each byte once, fewest requests)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return None
    ckpt_dir = location(ckpt_dir)
    if not is_delta(manifest):
        if INDEX not in manifest:
            return None
        reader = RowReader(ckpt_dir, manifest)
        shards, got = reader.restore(wanted, group)
        return shards, got, reader.bytes_read
    base = delta_base(ckpt_dir, manifest)
    bm = read_manifest(base)
    if INDEX not in bm:
        return None
    delta = read_spread([ckpt_dir / s for s in manifest["shards"]], group, ckpt_dir)
    found, rest, sizes = {}, {}, dict(zip(manifest["tables"], manifest["table_rows"]))
    for table, rows in wanted.items():  # the wanted rows the delta holds (its own row ids), the rest from the base
        if table not in sizes:
            raise FormatError(f"{ckpt_dir}: no table {table!r} in the checkpoint")
        rows = np.asarray(rows, dtype=np.int64)
        pos = _delta_positions(delta, table, int(sizes[table]), ckpt_dir)
        at = pos[rows] if rows.size else rows
        found[table] = at
        rest[table] = rows[at < 0]
    reader = RowReader(base, bm)
    base_files, got = reader.restore(rest, group)
    shards = _overlay(ckpt_dir, manifest, delta, [{**sh, "tables": {}} for sh in base_files])
    out, nbytes = {}, reader.bytes_read
    for table, at in found.items():
        _, dw, dm = table_pieces(shards, table)
        bw, bmom = got[table]
        hit = torch.from_numpy(at >= 0)
        dw = dw if dw is not None else bw[:0]
        w = torch.empty((at.size, dw.shape[1]), dtype=dw.dtype)
        w[~hit], w[hit] = bw, dw[torch.from_numpy(at[at >= 0])]
        mom = None
        if bmom is not None or (dm is not None and hit.any()):
            dm = dm if dm is not None else bmom[:0]
            mom = torch.empty(at.size, dtype=dm.dtype)
            mom[~hit], mom[hit] = bmom, dm[torch.from_numpy(at[at >= 0])]
        nbytes += int(hit.sum()) * (w.shape[1] * w.element_size() + (mom.element_size() if mom is not None else 0))
        out[table] = (w, mom)
    return shards, out, nbytes


def _delta_positions(delta: list[dict], table: str, num_rows: int, where) -> np.ndarray:
    """For every row of ``table``: its position among the delta's rows of it (``table_pieces`` order), -1 for a
    row the delta does not hold."""
    rows, _, _ = table_pieces(delta, table)
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise FormatError(f"{where}: table {table!r} has a saved row {int(rows.max())} outside [0, {num_rows})")
    pos = np.full(num_rows, -1, dtype=np.int64)
    pos[rows] = np.arange(rows.size)
    return pos


ROLLING_PROFILE = "rolling_profile"  # a full checkpoint's rank file: that rank's rolling profile (train.replan)
MANAGED = "managed"  # every rank's entry: its mapping shards of the managed tables (embedding.managed_lookup)


def load_managed(lookup, shards: list[dict], where) -> None:
    """Restore the managed tables' id mappings: every rank file's ``MANAGED`` shards merged (each written by the
    rank that hosted it), each table taking the shards it hosts now, on any world size; a checkpoint without
    them is a ``FormatError``."""
    state = merged(shards, MANAGED)
    if not state:
        raise FormatError(f"{where}: no id mappings of managed tables in the checkpoint; this model manages "
                          f"{sorted(lookup.specs)}")
    lookup.load_state_dict(state, where)


def rank0(shards: list[dict]) -> dict:
    return next(sh for sh in shards if sh["rank"] == 0)


def merged(shards: list[dict], key: str) -> dict:
    """The union of the ``key`` dicts of every rank file (dense state, named optimizer state)."""
    out: dict = {}
    for sh in shards:
        out.update(sh.get(key) or {})
    return out


def table_pieces(shards: list[dict], name: str) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor | None]:
    """``(rows, weight, momentum)`` of table ``name`` concatenated over the rank files (row order as stored)."""
    rows, ws, ms = [], [], []
    for sh in shards:
        e = (sh.get("tables") or {}).get(name)
        if e is None:
            continue
        rows.append(entry_rows(e))
        ws.append(e["weight"])
        if "momentum" in e:
            ms.append(e["momentum"])
    if not rows:
        return np.zeros(0, np.int64), None, None
    return np.concatenate(rows), torch.cat(ws), (torch.cat(ms) if len(ms) == len(ws) else None)


def assemble_table(shards: list[dict], name: str, num_rows: int, where: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Table ``name`` whole (``[num_rows, dim]`` weight and row-wise state or ``None``) from the rank files;
    a row that no file holds (or a table the checkpoint lacks) is a ``FormatError`` naming table and row."""
    rows, w, m = table_pieces(shards, name)
    if w is None:
        raise FormatError(f"{where}: no rows of table {name!r} in the checkpoint")
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise FormatError(f"{where}: table {name!r} has a saved row {int(rows.max())} outside [0, {num_rows})")
    covered = np.zeros(num_rows, dtype=bool)
    covered[rows] = True
    if not covered.all():
        raise FormatError(f"{where}: no rank file holds row {int(np.argmin(covered))} of table {name!r} "
                          f"({num_rows} rows)")
    idx = torch.from_numpy(rows)
    weight = torch.empty((num_rows, w.shape[1]), dtype=w.dtype)
    weight[idx] = w
    mom = None
    if m is not None:
        mom = torch.empty(num_rows, dtype=m.dtype)
        mom[idx] = m
    return weight, mom


def load_checkpoint(path: str | Path) -> dict:
    """A whole checkpoint in one process (tools, tests, ``embedscale evaluate``): ``manifest``, ``step``,
    ``epoch``, ``batch_in_epoch``, ``samples``, ``config_yaml``, ``losses``, ``tables`` (``{name: {"weight",
    "momentum"}}`` whole), ``dense``, ``optimizer`` (by parameter name), ``optimizer_groups``, ``host``, ``tt``,
    ``reorder`` (the index reordering the TT cores were trained under, ``{table: map}``; ``{}`` without),
    ``managed`` (the managed tables' id mappings; ``{}`` without). ``path`` is a checkpoint or a run directory (its latest checkpoint)."""
    ckpt = resolve_checkpoint(path)
    m = read_manifest(ckpt)
    shards = read_shards(ckpt, m)
    r0 = rank0(shards)
    tables = {}
    for name, n in zip(m["tables"], m["table_rows"]):
        w, mom = assemble_table(shards, name, n, ckpt)
        tables[name] = {"weight": w, **({"momentum": mom} if mom is not None else {})}
    return {"path": ckpt, "manifest": m, "step": m["step"], "epoch": m["epoch"],
            "batch_in_epoch": m["batch_in_epoch"], "samples": m["samples"], "config_yaml": m.get("config_yaml", ""),
            "losses": [float(x) for x in r0.get("losses", [])], "tables": tables, "dense": merged(shards, "dense"),
            "optimizer": merged(shards, "optimizer"), "optimizer_groups": r0.get("optimizer_groups", []),
            "host": r0.get("host", {}), "tt": r0.get("tt", {}), "reorder": r0.get("reorder", {}),
            MANAGED: merged(shards, MANAGED)}


# -- writing ----------------------------------------------------------------------------------------
def begin(ckpt_dir: Path | ObjectPath) -> Path | ObjectPath:
    """Rank 0, before any rank writes ``ckpt_dir``: remove the temporary directories earlier writes left (killed
    or failed; the run's lock makes this the only writer) and make an empty one for this checkpoint. On an
    object store the step directories without a manifest are those leftovers, and a complete checkpoint of
    this step (written again) loses its manifest first, then its parts: a reader never takes it half-rewritten."""
    if isinstance(ckpt_dir, ObjectPath):
        for p in ckpt_dir.parent.iterdir():
            if _STEP.match(p.name) and p != ckpt_dir and not is_checkpoint(p):
                remove_tree(p)
        (ckpt_dir / MANIFEST).unlink(missing_ok=True)
        remove_tree(ckpt_dir)
        return ckpt_dir
    tmp = temp_dir(ckpt_dir)
    if tmp.parent.is_dir():
        for p in tmp.parent.iterdir():
            if is_temp(p) and p.name.startswith(".step-") and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


_RENAME_EXCHANGE = 2  # renameat2(2) flag: swap two paths atomically (Linux 3.15+)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2``); ``False`` where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(tmp: Path, ckpt_dir: Path) -> None:
    """Rank 0, once ``tmp`` holds every rank file and the manifest: rename it to ``ckpt_dir``. A checkpoint of the
    same step there already (a step written again) is swapped out in one step and removed, so a reader finds the
    old one or the new one at ``ckpt_dir``, never neither (where the swap is unsupported, it is renamed aside
    first: a moment without it). On an object store ``tmp`` is ``ckpt_dir``, complete once its manifest is there."""
    if isinstance(ckpt_dir, ObjectPath):
        return
    if ckpt_dir.is_dir() and not ckpt_dir.is_symlink():
        if not _exchange(tmp, ckpt_dir):
            old = ckpt_dir.with_name(f".{ckpt_dir.name}.old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(ckpt_dir, old)
            os.rename(tmp, ckpt_dir)
            tmp = old
        shutil.rmtree(tmp, ignore_errors=True)  # the replaced checkpoint
    else:
        os.rename(tmp, ckpt_dir)
    fd = os.open(ckpt_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself on disk
    finally:
        os.close(fd)


def _status(e: BaseException | None) -> int:
    """What a rank tells the others of its part of a write: 0 done, an errno (an ``OSError``), -1 another error."""
    if e is None:
        return 0
    return e.errno if isinstance(e, OSError) and e.errno else -1


def agree(rank: int, world: int, ckpt_dir: Path, error: BaseException | None) -> None:
    """Every rank, after its part of writing ``ckpt_dir`` (``error``: what it raised, or ``None``): all learn
    whether any part failed (one all-gather), so no rank goes on while another has stopped. On a failure rank 0
    removes the temporary directory; the first failing rank raises its error (an ``OSError`` becomes a
    :class:`CheckpointWriteError` naming the checkpoint, the file and the cause), every other rank exits quietly
    (``SystemExit(2)``): one error for the whole run, no traceback from a peer whose collective broke."""
    codes = [_status(error)]
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(out, torch.tensor([codes[0]], dtype=torch.int64))
            codes = [int(t) for t in out]
    failed = [r for r, c in enumerate(codes) if c != 0]
    if not failed:
        return
    if rank == 0:
        remove_tree(temp_dir(ckpt_dir))
    if error is None or rank != failed[0]:
        raise SystemExit(2)
    if not isinstance(error, OSError) or not error.errno:
        raise error
    name = location(error.filename) if error.filename else None
    where = f"{name.name if name.parent == temp_dir(ckpt_dir) else name}: " if name else ""
    others = (f" (rank{'s' if len(failed) > 2 else ''} {', '.join(map(str, failed[1:]))} failed too)"
              if failed[1:] else "")
    latest = latest_checkpoint(ckpt_dir.parent)
    who = f"rank {rank}: " if world > 1 else ""
    raise CheckpointWriteError(f"{who}cannot write checkpoint {ckpt_dir}: {where}{os.strerror(error.errno)}"
                               f"{others}; nothing of it was kept, the latest complete checkpoint is "
                               f"{latest if latest is not None else 'none'}", error.errno) from None


def write_rank_file(ckpt_dir: Path | ObjectPath, rank: int, payload: dict) -> Path | ObjectPath:
    """This rank's part, written atomically (a temporary file renamed; on an object store one PUT)."""
    ckpt_dir = location(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / rank_file(rank)
    try:
        if isinstance(path, ObjectPath):
            buf = io.BytesIO()
            torch.save(payload, buf)
            path.write_bytes(buf.getbuffer())
            write_rank_index(path, payload, buf.getbuffer())
            return path
        with atomic_open(path, "wb") as f:
            torch.save(payload, f)
    except RuntimeError as e:  # torch's zip writer wraps a failed write (a full disk) in a RuntimeError
        cause = _os_error(e)
        if cause is None:
            raise
        raise OSError(cause.errno, os.strerror(cause.errno), str(path)) from e
    write_rank_index(path, payload, path)  # which rows it holds where, for restores that read only theirs (ckpt_rows)
    return path


def _os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` with an errno behind ``e`` (its cause or context chain), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def write_manifest(ckpt_dir: Path, world: int, fields: dict, delta: dict | None = None) -> Path:
    """The manifest (rank 0, after every rank file is written): marks the checkpoint complete. ``delta``:
    the base of a delta checkpoint (:func:`base_ref`)."""
    shards = [rank_file(r) for r in range(world)]
    index, sizes = collect_index(ckpt_dir, shards) if delta is None else (None, None)
    m = {"format": FORMAT, "version": VERSION if delta is None else DELTA_VERSION, "world_size": world, **fields,
         "id": uuid.uuid4().hex, **({"delta": dict(delta)} if delta is not None else {}),
         "shards": shards, **({INDEX: index} if index is not None else {}),
         **({SIZES: sizes} if index is not None and sizes is not None else {})}
    write_bytes(ckpt_dir / MANIFEST, (json.dumps(m, indent=2) + "\n").encode())
    for s in shards:  # the manifest holds every rank's index now; the step keeps its manifest and rank files only
        (ckpt_dir / index_name(s)).unlink(missing_ok=True)
    return ckpt_dir / MANIFEST


def base_ref(ckpt_dir: Path) -> dict:
    """What a delta's manifest says of its base, the complete full checkpoint ``ckpt_dir``."""
    m = read_manifest(ckpt_dir)
    if is_delta(m):
        raise FormatError(f"{ckpt_dir}: a delta checkpoint cannot be a base")
    return {"base": ckpt_dir.name, "base_step": m["step"], "base_id": m["id"]}


def delta_entry(rows: np.ndarray | torch.Tensor, weight: torch.Tensor, momentum: torch.Tensor | None,
                num_rows: int) -> dict:
    """A delta's table entry: rows ``rows`` (ids in a table of ``num_rows`` rows) with their ``weight`` and
    row-wise ``momentum``; the ids as int32, or as a bitmap when it is smaller (``num_rows / 8`` bytes
    against 4 per row; the rows then sorted)."""
    rows = torch.as_tensor(rows).to(HOST).numpy().astype(np.int64, copy=False)
    weight, momentum = weight.detach().to(HOST), (momentum.detach().to(HOST) if momentum is not None else None)
    if -(-num_rows // 8) < 4 * rows.size:
        order = np.argsort(rows, kind="stable")
        if rows.size > 1 and (np.diff(rows) < 0).any():
            idx = torch.from_numpy(order)
            rows, weight = rows[order], weight[idx]
            momentum = momentum[idx] if momentum is not None else None
        mask = np.zeros(num_rows, dtype=bool)
        mask[rows] = True
        e = {"rows_bitmap": torch.from_numpy(np.packbits(mask)), "bitmap_rows": int(num_rows)}
    else:
        dt = np.int32 if num_rows <= np.iinfo(np.int32).max else np.int64
        e = {"rows": torch.from_numpy(rows.astype(dt))}
    e["weight"] = weight.clone()
    if momentum is not None:
        e["momentum"] = momentum.clone()
    return e


__all__ = ["BEST", "DELTA_VERSION", "FORMAT", "MANIFEST", "VERSION", "agree", "assemble_table", "base_ref",
           "bases_in_use", "begin", "best_checkpoint", "best_pointer", "delta_base", "delta_entry", "entry_rows",
           "is_checkpoint", "is_delta", "is_temp", "latest_checkpoint", "load_checkpoint", "merged", "publish",
           "rank0", "rank_file", "read_manifest", "read_rows", "read_shard", "read_shards", "resolve_checkpoint", "step_dir",
           "table_pieces", "temp_dir", "write_best", "write_manifest", "write_rank_file"]
