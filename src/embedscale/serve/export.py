"""``embedscale export``: a checkpoint -> one self-contained, versioned model directory.

An export directory holds two files and needs nothing else (no run directory, no dataset, no TorchRec):

- ``weights.safetensors``: the dense model's state (``dense.<name>``), every table in its served form
  (``table.<name>``: float32, float16, or the fused row-wise INT8/INT4 rows of :mod:`embedscale.serve.quantize`)
  and, for a vocabulary-encoded dataset, each feature's vocabulary (``vocab.<feature>``: the key of row ``i``
  at ``i - 1``, uint64 stored as int64);
- ``export.json``: the manifest: format and version, ``model_version``, the dense model's config, the tables
  (features, rows, dim, pooling, served form, bytes per row), the encoding of raw rows (schema, hash or
  vocabulary, table rows, standardisation statistics), the source run, checkpoint, step and checkpoint id, and
  the eval figures the checkpoint recorded.

The tables are materialised whole from the checkpoint's rank files by row id (``train.checkpoint``: a checkpoint
of any world size), so an export of an N-rank run is the same as one of a single process. The directory is
written under a temporary name beside ``--out`` and renamed into place (an export already there is replaced
only once the new one is complete). ``export RUN --follow`` (:func:`follow_run`) keeps an export the latest
checkpoint of a run still training (online training's delta checkpoints included), for a server that follows
it (``serve --follow``): serving reads exports, never a run. Row-stored tables (device or host placed) are exported in the form asked; TT-compressed tables
as their cores (``serve.tt_tables``); managed-id tables and DMT tower models are not yet (an error says so).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from embedscale.assemble import prepare_data, split_existing, tables_for
from embedscale.data.shards import Manifest
from embedscale.errors import ConfigError, FormatError
from embedscale.io import atomic_write_json
from embedscale.serve.auto_quantize import Scorer, choose_forms, eval_batches
from embedscale.serve.quantize import FORMS, quantize_rows, row_bytes
from embedscale.serve.tt_tables import tt_entry
from embedscale.specs import RunConfig, from_dict
from embedscale.train.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint, resolve_checkpoint
from embedscale.train.checkpoint import read_manifest as read_checkpoint_manifest

FORMAT = "embedscale.export"
VERSION = 1
MANIFEST = "export.json"
WEIGHTS = "weights.safetensors"
MODEL_KEYS = ("arch", "embedding_dim", "bottom_mlp", "top_mlp", "cross_layers", "cross_low_rank")


def source_checkpoint(path: str | Path) -> Path:
    """The checkpoint an export reads: a checkpoint directory as given; of a run directory its
    ``checkpoints/best``, else its latest checkpoint."""
    p = Path(path)
    if p.is_dir() and not (p / "manifest.json").is_file():
        best = best_checkpoint(p)
        if best is not None:
            return best
    return resolve_checkpoint(p)


def table_forms(quantize: str | dict, names: list[str]) -> dict[str, str]:
    """``{table: form}`` from one form for every table or a ``{table: form}`` mapping (others fp32)."""
    forms = {n: quantize for n in names} if isinstance(quantize, str) else {n: quantize.get(n, "fp32") for n in names}
    if not isinstance(quantize, str):
        unknown = sorted(set(quantize) - set(names))
        if unknown:
            raise ConfigError(f"--quantize: unknown table(s) {', '.join(unknown)}; tables: {', '.join(names)}")
    bad = sorted({f for f in forms.values() if f not in FORMS})
    if bad:
        raise ConfigError(f"--quantize: {', '.join(bad)} is not one of {', '.join(FORMS)}")
    return forms


def export(source: str | Path, out: str | Path, quantize: str | dict = "fp32", data_dir: str | Path | None = None,
           *, tolerance: float = 0.001, table_budget: int | None = None, auto_samples: int = 100_000,
           progress: bool = False) -> dict:
    """Export ``source`` (a checkpoint, or a run directory: its best checkpoint, else its latest) into ``out``;
    ``quantize``: a served form for every table (fp32, fp16, int8, int4), ``{table: form}``, or ``auto``
    (:mod:`embedscale.serve.auto_quantize`: each table at the narrowest form whose eval AUC, over at most
    ``auto_samples`` rows of the run's eval split, stays within ``tolerance`` of FP32; then ``table_budget``
    bytes, if given). ``data_dir``: the training dataset (default: the run config's, from its data cache).
    Returns the manifest."""
    ck = source_checkpoint(source)
    state = load_checkpoint(ck)
    m = state["manifest"]
    cfg = from_dict(RunConfig, yaml.safe_load(state["config_yaml"] or "") or {})
    _check_exportable(ck, m, cfg, state)
    prepared = split_existing(Path(data_dir), 0.0) if data_dir else prepare_data(cfg, progress=False)
    data = prepared.manifest
    all_specs = tables_for(cfg, data)
    tt_names = set(m.get("tt_tables", []))
    specs = [t for t in all_specs if t.name not in tt_names]  # row tables; TT ones go as cores
    tt_tables, tt_tensors = _tt_tables(ck, state, [t for t in all_specs if t.name in tt_names])
    weights = {t.name: _table_weight(ck, state, t.name) for t in specs}
    for t in specs:
        if tuple(weights[t.name].shape) != (t.num_rows, t.dim):
            raise FormatError(f"{ck}: table {t.name!r} is {tuple(weights[t.name].shape)} in the checkpoint, the "
                              f"dataset {data_dir or cfg.data.path} says {(t.num_rows, t.dim)}")
    auto = None
    if quantize == "auto":
        if prepared.eval is None:
            raise ConfigError(f"{ck}: --quantize auto measures AUC on the run's eval split, and the run has none; "
                              "choose a form (fp32, fp16, int8, int4)")
        scorer = Scorer({k: getattr(cfg.model, k) for k in MODEL_KEYS}, all_specs, data.num_dense, state["dense"],
                        weights,
                        eval_batches(prepared.eval.directory, prepared.eval.start, prepared.eval.stop, auto_samples),
                        tt_tables, tt_tensors)
        quantize, auto = choose_forms(scorer, specs, tolerance, table_budget, progress)
    forms = table_forms(quantize, [t.name for t in specs])
    tensors: dict[str, torch.Tensor] = {f"dense.{k}": v.contiguous() for k, v in state["dense"].items()}
    tensors.update(tt_tensors)
    tables = []
    for t in specs:
        tensors[f"table.{t.name}"] = quantize_rows(weights[t.name], forms[t.name])
        tables.append({"name": t.name, "features": list(t.features), "num_rows": t.num_rows, "dim": t.dim,
                       "pooling": t.pooling, "form": forms[t.name], "bytes_per_row": row_bytes(forms[t.name], t.dim)})
    order = {t.name: i for i, t in enumerate(all_specs)}  # the trained embedding's table order
    tables = sorted(tables + tt_tables, key=lambda t: order[t["name"]])
    encoding, vocab = _encoding(data, Path(prepared.train.directory))
    tensors.update({f"vocab.{n}": torch.from_numpy(np.ascontiguousarray(v).view(np.int64)) for n, v in vocab.items()})
    version = f"step{m['step']}-{str(m.get('id', ''))[:8]}-" + (
        "auto" if auto else quantize if isinstance(quantize, str) else "mixed")
    es = m.get("early_stopping") or {}
    manifest = {
        "format": FORMAT, "version": VERSION, "model_version": version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {"run": str(Path(ck).resolve().parent.parent), "checkpoint": str(Path(ck).resolve()),
                   "step": m["step"], "checkpoint_id": m.get("id"), "samples": m.get("samples")},
        "eval": es.get("best") or es.get("eval") or {},
        "model": {k: getattr(cfg.model, k) for k in MODEL_KEYS}, "num_dense": data.num_dense,
        "tables": tables, "encoding": encoding, "weights": WEIGHTS,
        "table_bytes": int(sum(t["bytes"] if t["form"] == "tt" else t["bytes_per_row"] * t["num_rows"]
                               for t in tables)),
    }
    if auto:
        manifest["quantize_auto"] = auto
    write_export(Path(out), manifest, tensors)
    return manifest


def follow_run(run: str | Path, out: str | Path, quantize: str | dict = "fp32", *, poll_s: float = 2.0,
               max_exports: int = 0, idle_s: float = 0.0, stop=None, data_dir: str | Path | None = None,
               log=print) -> int:
    """Keep ``out`` the export of a training run's latest checkpoint (full or delta): every ``poll_s`` seconds,
    a new complete checkpoint (another manifest ``id``) is exported (written beside ``out``, then renamed over
    it), which ``embedscale serve --follow OUT`` swaps in. Stops after ``max_exports`` exports, after ``idle_s``
    seconds without a new checkpoint, or when ``stop()`` is true (each 0: never); returns the exports made. A
    checkpoint that cannot be read (removed by the run's retention while it was read) is retried at the next
    poll; the export serving meanwhile stays as it was."""
    done, seen, last_new = 0, None, time.monotonic()
    while not (stop and stop()):
        ck = latest_checkpoint(run)
        key = (ck, read_checkpoint_manifest(ck).get("id")) if ck is not None else None
        if key is not None and key != seen:
            try:
                m = export(ck, out, quantize, data_dir)
            except (FormatError, OSError) as e:
                log(f"export --follow {run}: {ck.name} not exported ({e}); retrying")
            else:
                seen, done, last_new = key, done + 1, time.monotonic()
                log(f"export --follow {run}: {out} is now {m['model_version']} (step {m['source']['step']})")
                if max_exports and done >= max_exports:
                    break
        if idle_s and time.monotonic() - last_new > idle_s:
            break
        time.sleep(poll_s)
    return done


def _check_exportable(ck: Path, m: dict, cfg: RunConfig, state: dict) -> None:
    if m.get("kind") == "dmt" or cfg.model.arch.startswith("dmt-"):
        raise FormatError(f"{ck}: a DMT tower model ({cfg.model.arch}); export serves dlrm and dcn models")
    if state.get("managed"):
        raise FormatError(f"{ck}: managed-id tables are not exported yet (their id mappings change as they train)")


def _tt_tables(ck: Path, state: dict, specs: list) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The TT tables' manifest entries and tensors (``serve.tt_tables``: cores, hot rows, the reordering)."""
    entries, tensors = [], {}
    for t in specs:
        entry, ts = tt_entry(t.name, list(t.features), t.num_rows, t.dim, t.pooling, state.get("tt") or {})
        reorder = (state.get("reorder") or {}).get(t.name)
        if reorder is not None:
            ts[f"reorder.{t.name}"] = torch.as_tensor(np.asarray(reorder), dtype=torch.int64).contiguous()
        entries.append(entry)
        tensors.update(ts)
    return entries, tensors


def _table_weight(ck: Path, state: dict, name: str) -> torch.Tensor:
    if name in state["tables"]:
        return state["tables"][name]["weight"]
    w = (state.get("host") or {}).get(f"{name}.weight")
    if w is None:
        raise FormatError(f"{ck}: no rows of table {name!r} in the checkpoint")
    return w


def _encoding(data: Manifest, directory: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The export's ``encoding`` section and the vocabularies (vocab datasets) of the training dataset."""
    x = data.extra
    enc = {"dense": list(data.dense_names),
           "sparse": [{"name": s.name, "num_rows": s.num_rows, "multi_hot": bool(s.multi_hot)} for s in data.sparse],
           "schema": x.get("schema"), "categorical": x.get("categorical", "ids"),
           "dense_stats": x.get("dense_stats")}
    if enc["schema"] is None:
        enc["categorical"] = "ids"  # synthetic or shard data: the values are the rows
    vocab = {}
    if enc["categorical"] == "vocab":
        for s in data.sparse:
            f = directory / f"vocab-{s.name}.npy"
            if not f.is_file():
                raise FormatError(f"{directory}: the vocabulary of feature {s.name!r} ({f.name}) is missing")
            vocab[s.name] = np.load(f, allow_pickle=False).astype(np.uint64, copy=False)
    return enc, vocab


def write_export(out: Path, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write the directory under a temporary name beside ``out``, then rename it into place (an export already
    at ``out`` is replaced once the new one is complete; anything else there is an error)."""
    from safetensors.torch import save_file

    if out.exists() and not (out.is_dir() and ((out / MANIFEST).is_file() or not any(out.iterdir()))):
        raise ConfigError(f"{out}: exists and is not a model export (no {MANIFEST}); choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT, "model_version": manifest["model_version"]})
        atomic_write_json(tmp / MANIFEST, manifest)
        os.chmod(tmp, 0o755)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["FORMAT", "MANIFEST", "VERSION", "WEIGHTS", "export", "follow_run", "source_checkpoint", "table_forms",
           "write_export"]
