"""Training data as a stream: shards that arrive in a directory while a run trains on them.

The contract a producer follows (``StreamWriter`` does it; a user's own pipeline can do it by hand)::

    DIR/stream.json        the schema, written once before the first shard (atomically: temporary, rename):
                           {"format": "embedscale.stream", "version": 1, "dense_names": [...],
                            "sparse": [{"name", "num_rows", "multi_hot"}...], "weighted": false}
    DIR/shard-00000.arrow  shards in the format of ``data.shards`` (same columns as a dataset's), numbered
    DIR/shard-00001.arrow  0, 1, 2, ... without gaps; each written under another name (``.shard-00001.arrow.tmp``:
    ...                    a name that does not match ``shard-NNNNN.arrow``) and renamed into place when complete.
    DIR/END                written after the last shard was renamed into place: the stream has ended. It may hold
                           ``{"shards": N}``: the stream has shards 0..N-1 (a missing one is then an error).

**A shard is complete when its file has its final name**: the rename is atomic, so the loader never sees a
half-written shard (a temporary or any name other than ``shard-NNNNN.arrow`` is never opened). Shards are read
in number order: shard ``i + 1`` waits for shard ``i``. A finished dataset (``manifest.json``, as
``embedscale data`` writes it) is also a stream: its manifest is the schema and the end (its listed shards).

The stream ends at the ``END`` marker, or (``idle_s > 0``) when no new shard has arrived for ``idle_s``
seconds. Several ranks must agree on where it ends. The marker (written after every shard) gives every rank
the same shards when each follows the directory on its own; an idle clock would not (rank 0 could give up on
shard ``i`` a moment before rank 1 sees it arrive). So with an idle end, rank 0 alone watches the directory
and records in a *follow file* (in the run directory, shared by the ranks) each shard it admits before it
reads it, or where the stream ended and why; the other ranks read shard ``i`` only once rank 0 admitted it and
end where it ended (``follow``: the file and this attempt's token; a record of another attempt or start
position is not theirs).

The loader (:class:`StreamLoader`) cuts global batches across shard boundaries exactly like
:class:`~embedscale.data.loader.ShardLoader` (every rank gets its contiguous slice of the same global
batches, in the same order; ids validated once) and keeps at most two shards memory-mapped plus ``prefetch``
batches. Each batch carries ``stream_position``: ``{"shard": i, "row": r}``, where the next batch starts. The
run loop keeps the position of the last trained batch in the run state (the checkpoint manifest), and
``seek(position)`` resumes at that exact shard and row: shards before it are never opened again (a producer
may delete them).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from embedscale.data.loader import (ShardLoader, block_sparse, check_batching, check_raw_ids, _Block, _prefetched,
                                     _sel_len, _slice_sparse)
from embedscale.data.shards import (MANIFEST, Manifest, SparseFeatureInfo, arrow_schema, read_shard, record_batch,
                                    write_shard_file)
from embedscale.errors import ConfigError, FormatError
from embedscale.io import atomic_write_json, atomic_write_text, read_json

SCHEMA = "stream.json"
END = "END"
FORMAT = "embedscale.stream"
VERSION = 1
_SHARD = re.compile(r"^shard-(\d{5,})\.arrow$")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.arrow"


def read_stream_schema(directory: str | os.PathLike, key: str = "data.path") -> Manifest:
    """The stream's schema as a ``Manifest`` (no shards listed): ``stream.json``, or a finished dataset's
    ``manifest.json``. A missing directory or schema is a ``ConfigError`` naming the directory and ``key``."""
    d = Path(directory)
    if not str(directory):
        raise ConfigError(f"{key}: data.source is 'stream' but no stream directory is given")
    if not d.is_dir():
        raise ConfigError(f"{key}: stream directory {d} does not exist (or is not a directory)")
    if (d / SCHEMA).exists():
        j = read_json(d / SCHEMA, "stream schema")
        if not isinstance(j, dict) or j.get("format") != FORMAT:
            raise FormatError(f"{d / SCHEMA}: not an embedscale stream schema (format="
                              f"{j.get('format') if isinstance(j, dict) else None!r}, want {FORMAT!r})")
        if j.get("version") != VERSION:
            raise FormatError(f"{d / SCHEMA}: stream schema version {j.get('version')!r} is not {VERSION}")
        try:
            sparse = [SparseFeatureInfo(str(s["name"]), int(s["num_rows"]), bool(s.get("multi_hot", False)))
                      for s in j["sparse"]]
            m = Manifest([str(n) for n in j["dense_names"]], sparse, [], {"stream": True},
                         bool(j.get("weighted", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{d / SCHEMA}: malformed stream schema ({type(e).__name__}: {e})") from None
        for s in m.sparse:
            if s.num_rows <= 0:
                raise FormatError(f"{d / SCHEMA}: feature {s.name!r} has {s.num_rows} rows")
        return m
    if (d / MANIFEST).exists():  # a finished dataset: a stream that has ended
        m = Manifest.load(d)
        return Manifest(m.dense_names, m.sparse, [], {**m.extra, "stream": True, "finished_shards": len(m.shards)},
                        m.weighted)
    raise ConfigError(f"{key}: {d} is not a stream directory: no {SCHEMA} (the stream's schema, written before "
                      f"the first shard, e.g. by embedscale.data.stream.StreamWriter) and no {MANIFEST}")


def complete_shards(directory: str | os.PathLike) -> list[Path]:
    """The complete shards present now, in order: ``shard-00000.arrow``, ``shard-00001.arrow``, ... up to the
    first missing number (temporaries and other names are not shards)."""
    d = Path(directory)
    out = []
    while (d / shard_name(len(out))).exists():
        out.append(d / shard_name(len(out)))
    return out


class StreamWriter:
    """The producer's side of the contract: the schema first, then shards renamed into place, then ``END``.

    Example (a pipeline that writes a shard every few minutes)::

        w = StreamWriter("stream/", ["age"], [SparseFeatureInfo("city", 100)])
        w.write_shard(np.array([0, 1]), np.array([[0.3], [0.7]]), {"city": np.array([4, 99])})
        ...
        w.end()

    A writer started on a directory that already has a schema continues after its last shard (the schema
    must be the same)."""

    def __init__(self, directory: str | os.PathLike, dense_names: list[str], sparse: list[SparseFeatureInfo],
                 weighted: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = Manifest(list(dense_names), list(sparse), [], {}, bool(weighted))
        self.schema = arrow_schema(len(dense_names), self.manifest.sparse, self.manifest.weighted)
        doc = {"format": FORMAT, "version": VERSION, "dense_names": list(dense_names),
               "sparse": [vars(s) for s in sparse], "weighted": bool(weighted)}
        if (self.dir / SCHEMA).exists():
            old = read_json(self.dir / SCHEMA, "stream schema")
            if old != doc:
                raise ConfigError(f"{self.dir / SCHEMA}: the stream has another schema than this writer's")
        else:
            atomic_write_json(self.dir / SCHEMA, doc)
        self.shards = len(complete_shards(self.dir))

    def write_shard(self, labels: np.ndarray, dense: np.ndarray, sparse: dict, weights: np.ndarray | None = None
                    ) -> Path:
        """One shard (columns as ``ShardWriter.write`` takes them), written under a temporary name and renamed."""
        n = len(labels)
        rb = record_batch(self.manifest, self.schema, n, labels, dense, sparse, weights, "StreamWriter",
                          ConfigError)
        table = pa.Table.from_batches([rb])
        name = shard_name(self.shards)
        tmp = self.dir / f".{name}.tmp"
        try:
            write_shard_file(tmp, self.schema, table, 0)  # page-aligned from the shard's own first row
            os.replace(tmp, self.dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.shards += 1
        return self.dir / name

    def end(self) -> None:
        """The stream has ended: ``END`` (with the shard count) after the last shard."""
        atomic_write_text(self.dir / END, f'{{"shards": {self.shards}}}\n')


def _end_count(path: Path) -> int | None:
    """The shard count an ``END`` marker states (``None``: an empty marker)."""
    text = path.read_text().strip()
    if not text:
        return None
    try:
        n = json.loads(text)["shards"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(n)
        return n
    except (ValueError, KeyError, TypeError):
        raise FormatError(f"{path}: an END marker is empty or {{\"shards\": N}}, got {text[:80]!r}") from None


class StreamLoader(ShardLoader):
    """Global batches of a stream directory (module docstring: the contract), this rank's slice of each.

    Args:
        directory: the stream directory.
        batch_size: global batch size (all ranks together); a batch spans shard boundaries, and only the
            stream's last batch may be smaller.
        rank, world_size: this rank's slice of every global batch.
        idle_s: end when no new shard has arrived for this many seconds (0 = only at the ``END`` marker;
            a world of one only, see the module docstring).
        poll_s: how often the directory is looked at while waiting for the next shard.
        prefetch, device, validate, raw_ids: as :class:`~embedscale.data.loader.ShardLoader`.

        follow: ``(path, token)`` of the follow file by which rank 0 decides for every rank (module
            docstring); needed with ``idle_s`` on several ranks.

    Attributes after a pass: ``end_reason`` (``"marker"``, ``"idle"`` or ``"dataset"``), ``shards_read``.
    """

    def __init__(self, directory: str | Path, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 idle_s: float = 0.0, poll_s: float = 0.2, prefetch: int = 2,
                 device: torch.device | str | None = None, validate: bool = True,
                 follow: tuple[Path, str] | None = None, raw_ids=()):
        self.directory = Path(directory)
        self.manifest = read_stream_schema(self.directory)
        check_batching(batch_size, rank, world_size)
        if idle_s < 0 or poll_s <= 0:
            raise ConfigError(f"data.stream_idle_s must be >= 0 and data.stream_poll_s > 0, got {idle_s}, {poll_s}")
        if idle_s and world_size > 1 and follow is None:
            raise ConfigError(f"data.stream_idle_s {idle_s}: several ranks end a stream by idle time only through "
                              "rank 0's follow file (each rank's own clock could stop at another shard)")
        self.follow = (Path(follow[0]), str(follow[1])) if follow is not None and world_size > 1 and idle_s else None
        self.batch_size = int(batch_size)
        self.rank, self.world_size = rank, world_size
        self.idle_s, self.poll_s = float(idle_s), float(poll_s)
        self.shuffle, self.drop_last = False, False
        self.prefetch, self.device, self.validate = prefetch, device, validate
        self.epoch, self.skip_batches = 0, 0
        self.feature_names = self.manifest.sparse_names
        self._num_rows = {s.name: s.num_rows for s in self.manifest.sparse}
        self.id_weighted = {s.name for s in self.manifest.sparse if s.id_weights}
        self.raw_ids = check_raw_ids(raw_ids, self.feature_names, self.directory)
        self._want = arrow_schema(self.manifest.num_dense, self.manifest.sparse, self.manifest.weighted)
        self.start = {"shard": 0, "row": 0}
        self.end_reason = ""
        self.shards_read = 0

    def __len__(self) -> int:
        raise TypeError("a stream has no length: it ends at its END marker or when idle")

    @property
    def rows(self) -> int:
        raise TypeError("a stream has no row count")

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """A stream is one pass: resume with :meth:`seek` (its position), never by skipping batches."""
        if epoch or skip_batches:
            raise ConfigError(f"{self.directory}: a stream is read once, from a position (seek); not epoch {epoch} "
                              f"after {skip_batches} batches")

    def seek(self, position: dict | None) -> None:
        """Start the next pass at ``{"shard": i, "row": r}`` (``None`` or ``{}``: the stream's start)."""
        p = dict(position or {"shard": 0, "row": 0})
        try:
            shard, row = int(p["shard"]), int(p["row"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"stream position {position!r} is not {{'shard': i, 'row': r}}") from None
        if shard < 0 or row < 0:
            raise FormatError(f"stream position {position!r} is negative")
        self.start = {"shard": shard, "row": row}

    # -- following the directory -----------------------------------------------------------------
    def _check_schema(self, path: Path) -> int:
        """The shard's columns are the stream's (names and types); its row count."""
        try:
            with pa.memory_map(str(path), "r") as source:
                reader = ipc.open_file(source)
                schema = reader.schema
                n = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{path}: not a readable Arrow shard ({e})") from None
        for f in self._want:
            i = schema.get_field_index(f.name)
            if i < 0 or schema.field(i).type != f.type:
                have = "missing" if i < 0 else str(schema.field(i).type)
                raise FormatError(f"{path}: column {f.name!r} is {have}; the stream's schema "
                                  f"({self.directory / SCHEMA}) says {f.type}")
        return n

    def _next_shard(self, i: int, since: float) -> Path | None:
        """Shard ``i``'s path once it may be read, or ``None`` when the stream has ended (``end_reason``): the
        directory's word, or with a follow file rank 0's (the others wait for it)."""
        if self.follow is None:
            return self._watch(i, since)
        if self.rank != 0:
            return self._admitted(i)
        path = self._watch(i, since)
        self._record(admitted=i + 1 if path is not None else i, ended=None if path is not None else i)
        return path

    def _record(self, admitted: int, ended: int | None) -> None:
        """Rank 0: the follow file says shards ``< admitted`` may be read, and where the stream ended."""
        file, token = self.follow
        atomic_write_json(file, {"token": token, "start": self.start, "admitted": admitted, "ended": ended,
                                 "reason": self.end_reason if ended is not None else ""})

    def _admitted(self, i: int) -> Path | None:
        """Ranks other than 0: wait until rank 0 has admitted shard ``i`` or ended the stream before it."""
        file, token = self.follow
        while True:
            try:
                rec = json.loads(file.read_text())
            except (FileNotFoundError, ValueError):
                rec = None
            if isinstance(rec, dict) and rec.get("token") == token and rec.get("start") == self.start:
                if rec.get("admitted", 0) > i:
                    path = self.directory / shard_name(i)
                    if not path.exists():
                        raise FormatError(f"{file}: rank 0 admitted {path}, which this rank does not see")
                    return path
                if rec.get("ended") is not None and rec["ended"] <= i:
                    self.end_reason = str(rec.get("reason") or "idle")
                    return None
            time.sleep(self.poll_s)

    def _watch(self, i: int, since: float) -> Path | None:
        """Wait for shard ``i`` in the directory: its path, or ``None`` when the stream has ended."""
        path = self.directory / shard_name(i)
        finished = self.manifest.extra.get("finished_shards")
        while True:
            if finished is not None:  # a finished dataset: exactly its listed shards
                if i < finished:
                    if not path.exists():
                        raise FormatError(f"{self.directory / MANIFEST}: lists {finished} shards but {path} is missing")
                    return path
                self.end_reason = "dataset"
                return None
            if path.exists():
                return path
            end = self.directory / END
            if end.exists():
                if path.exists():  # renamed into place between the two looks
                    return path
                count = _end_count(end)
                if count is not None and i < count:
                    raise FormatError(f"{end}: says the stream has {count} shards but {path} is missing")
                self.end_reason = "marker"
                return None
            if self.idle_s and time.monotonic() - since >= self.idle_s:
                self.end_reason = "idle"
                return None
            time.sleep(self.poll_s)

    def _blocks(self) -> Iterator[_Block]:
        """The rows from the start position on, shard by shard as they arrive (one block per shard)."""
        i, row = self.start["shard"], self.start["row"]
        self.end_reason, self.shards_read = "", 0
        if self.follow is not None and self.rank == 0:  # this pass's record (the others wait for its start)
            self._record(admitted=i, ended=None)
        since = time.monotonic()
        while True:
            path = self._next_shard(i, since)
            if path is None:
                return
            n = self._check_schema(path)
            if row > n:
                raise FormatError(f"{path}: the run's stream position is row {row} but the shard has {n} rows "
                                  "(was the stream rewritten?)")
            cols = read_shard(path, self.manifest.num_dense)
            self.shards_read += 1
            sparse = block_sparse(cols)
            w = cols.weights
            blk = _Block(path.name, row, None, cols.labels[row:], cols.dense[row:], _slice_sparse(sparse, row, n),
                         None if w is None else w[row:])
            blk.index, blk.rows = i, n  # where the block sits in the stream
            yield blk
            i, row = i + 1, 0
            since = time.monotonic()

    def _row_batches(self) -> Iterator[tuple[list, dict]]:
        """Global batches as (pieces, the position after the batch)."""
        pieces: list = []
        have = 0
        for blk in self._blocks():
            n = len(blk.labels)
            pos = 0
            while pos < n:
                take = min(self.batch_size - have, n - pos)
                pieces.append((blk, slice(pos, pos + take)))
                have += take
                pos += take
                if have == self.batch_size:
                    yield pieces, _after(blk, pos)
                    pieces, have = [], 0
        if have:
            blk = pieces[-1][0]
            yield pieces, _after(blk, pieces[-1][1].stop)

    def __iter__(self) -> Iterator:
        def produce():
            for pieces, after in self._row_batches():
                batch = self._build(self._rank_pieces(pieces))
                batch.global_size = sum(_sel_len(sel) for _, sel in pieces)
                batch.stream_position = after
                yield batch

        if self.prefetch <= 0:
            yield from produce()
            return
        yield from _prefetched(produce(), self.prefetch)


def _after(blk: _Block, pos: int) -> dict:
    """The stream position just after row ``pos`` of ``blk`` (the next shard's start at a shard's end)."""
    row = blk.first_row + pos
    return {"shard": blk.index + 1, "row": 0} if row >= blk.rows else {"shard": blk.index, "row": row}


__all__ = ["END", "SCHEMA", "StreamLoader", "StreamWriter", "complete_shards", "read_stream_schema", "shard_name"]
