"""``embedscale towers``: learn a feature-to-tower assignment from a trained run (DMT 3.3).

A trained run directory (any arch: its tables hold the learned embeddings) plus the run's data give the
feature interaction matrix ``I(i, j) = mean_b |cos(R[b, i], R[b, j])|`` of the per-sample pooled
embeddings, and the tower partitioner (``embedscale.plan.towers``, the interaction matrix ``embedscale.towers.learn``: coherent or diverse distance,
coordinates fitted to it, constrained K-Means with max/min tower size ratio K) turns it into towers.

Outputs, written atomically, no pickle:

* ``OUT`` (JSON): the :class:`~embedscale.plan.towers.TowerAssignment` a DMT run reads with
  ``model.tower_assignment: OUT``; its ``meta`` says where it came from and how good it is;
* ``OUT`` with suffix ``.report.json``: the full report (interaction matrix, coordinates, scores of the
  learned and of the naive strided assignment);
* ``OUT`` with suffix ``.png``: the interaction matrix sorted by tower, towers outlined (DMT Figure 9).

Checkpoints read: the one format (``checkpoints/step-N/``, rows by table and row id, any world size); the
best evaluation's (``checkpoints/best``) of the run, else its latest, unless a checkpoint path is given.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from embedscale.errors import ConfigError, FormatError
from embedscale.io import atomic_write_json
from embedscale.specs import RunConfig, TableSpec, from_dict
from embedscale import assemble
from embedscale.data.loader import ShardLoader
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.plan.towers import STRATEGIES
from embedscale.towers.learn import learn_towers, plot_interaction
from embedscale.train.checkpoint import (assemble_table, best_checkpoint, is_checkpoint, latest_checkpoint,
                                        read_manifest, read_shards)


def _find_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(run directory, checkpoint)`` from a run directory or a checkpoint path."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such run directory or checkpoint")
    if is_checkpoint(path):  # a checkpoint: <run>/checkpoints/<ckpt>
        return path.parent.parent, path
    found = best_checkpoint(path) or latest_checkpoint(path)  # the best evaluation's, as evaluate and export
    if found is None:
        raise ConfigError(f"{path}: no checkpoint in {path / 'checkpoints'} (train the run first)")
    return path, found


def _run_config(run_dir: Path, checkpoint: Path) -> RunConfig:
    text = read_manifest(checkpoint).get("config_yaml")
    if not text:
        p = run_dir / "config.yaml"
        if not p.exists():
            raise ConfigError(f"{checkpoint}: no config.yaml in the run directory {run_dir}")
        text = p.read_text()
    return from_dict(RunConfig, yaml.safe_load(text) or {})


def load_table_weights(checkpoint: Path, tables: list[TableSpec]) -> dict[str, torch.Tensor]:
    """Every table's ``[num_rows, dim]`` weights from a checkpoint of any world size (``train.checkpoint``)."""
    m = read_manifest(checkpoint)
    rows = dict(zip(m.get("tables", []), m.get("table_rows", [])))
    for t in tables:
        if rows.get(t.name) != t.num_rows:
            raise FormatError(f"{checkpoint}: table {t.name!r} has {rows.get(t.name)} rows in the checkpoint, "
                              f"{t.num_rows} in the run (tensor-train and host-placed tables are not read by "
                              "embedscale towers)")
    shards = read_shards(checkpoint, m)
    return {t.name: assemble_table(shards, t.name, t.num_rows, checkpoint)[0].float() for t in tables}


def default_towers(cfg: RunConfig) -> int:
    """The towers a DMT run of this config would have: ``model.towers``, else one per tower group."""
    if cfg.model.towers:
        return cfg.model.towers
    return max(1, cfg.dist.topology_hosts // max(1, cfg.model.hosts_per_tower))


def towers_command(run: str | Path, out: str | Path | None = None, *, towers: int = 0, strategy: str = "coherent",
                   max_ratio: float = 1.0, samples: int = 65536, batch_size: int = 4096, coord_dim: int = 2,
                   seed: int = 0, center: bool = True, png: bool = True, progress: bool = True) -> dict:
    """Learn towers from a trained run (DMT 3.3) and write assignment, report and plot (module docstring).

    Args:
        run: a run directory (its latest checkpoint) or a checkpoint path.
        out: the assignment file (default ``<run>/learned-towers.json``).
        towers: T (default: the run config's ``model.towers``, else one per host of ``dist.topology_hosts``).
        strategy: ``coherent`` (similar features together) or ``diverse``.
        max_ratio: K, largest allowed max/min tower size ratio (raised to the smallest feasible one).
        samples: samples of the run's eval split (its train split if it has none) the interaction
            matrix averages over.
        batch_size, coord_dim, seed: reading batch, coordinate dimension (DMT: 2), partitioner seed.
        center: centre every feature's embeddings before the cosine (``False``: DMT's uncentred ``|cos|``,
            see ``partitioner.interaction_matrix``).
        png: also draw the interaction matrix.

    Returns:
        A summary: towers, sizes, scores of the learned and the naive assignment, paths written.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples <= 0:
        raise ConfigError(f"--samples must be a positive integer, got {samples!r}")
    run_dir, checkpoint = _find_checkpoint(Path(run))
    cfg = _run_config(run_dir, checkpoint)
    data = assemble.prepare_data(cfg, progress=progress)
    tables = assemble.tables_for(cfg, data.manifest)
    T = towers or default_towers(cfg)
    if T < 2:
        raise ConfigError(f"{run_dir}: the run has one host, so one tower; pass --towers T (T >= 2) for the hosts the "
                          "DMT model will train on")
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        raise ConfigError(f"tables have dims {sorted(dims)}; the cosine interaction (and DMT towers) need one shared dim")
    weights = load_table_weights(checkpoint, tables)
    emb = LocalEmbeddingBags([TableSpec(t.name, t.num_rows, t.dim, features=list(t.features), pooling=t.pooling)
                              for t in tables], optimizer=None)
    emb.load_state_dict({f"{k}.weight": v for k, v in weights.items()})
    split = data.eval or data.train
    stop = min(split.stop, split.start + samples)
    loader = ShardLoader(split.directory, batch_size, start=split.start, stop=stop, prefetch=0)
    assignment, report = learn_towers(emb, loader, T, strategy, max_ratio=max_ratio, coord_dim=coord_dim, seed=seed,
                                      center=center)
    used_samples = stop - split.start
    # a table read by several features must sit in one tower group when it trains (DMT 3.1: tables are whole)
    split_tables = [t.name for t in tables if len({assignment.tower_of(f) for f in t.features}) > 1]
    learned, naive = {k: report[k] for k in ("within_tower_interaction", "cross_tower_interaction",
                                             "within_tower_distance")}, report["naive"]
    out = Path(out) if out else run_dir / "learned-towers.json"
    assignment.meta.update({
        "source_run": str(run_dir), "checkpoint": str(checkpoint), "arch": cfg.model.arch, "samples": used_samples,
        "max_ratio_used": report["max_ratio_used"], "centered": center, "sizes": assignment.sizes, **learned,
        "naive": {k: naive[k] for k in learned}})
    assignment.save(out)
    report_path = out.with_suffix(".report.json")
    atomic_write_json(report_path, {**report, "checkpoint": str(checkpoint), "samples": used_samples})
    written = {"assignment": str(out), "report": str(report_path)}
    if png:
        plot_interaction(report, out.with_suffix(".png"))
        written["png"] = str(out.with_suffix(".png"))
    return {"towers": assignment.towers, "num_towers": T, "sizes": assignment.sizes, "strategy": strategy,
            "max_ratio_used": report["max_ratio_used"], "samples": used_samples, "checkpoint": str(checkpoint),
            "learned": learned, "naive": {k: naive[k] for k in learned}, "naive_towers": naive["towers"],
            "tables_split_across_towers": split_tables, "stress": report["stress"], "written": written}


def format_towers_summary(s: dict) -> str:
    lines = [f"{s['num_towers']} towers ({s['strategy']}, max/min size ratio {s['max_ratio_used']:.3g}) learnt from "
             f"{s['samples']:,} samples of {s['checkpoint']}"]
    for t, fs in enumerate(s["towers"]):
        lines.append(f"  tower {t}: {', '.join(fs)}")
    for name in ("learned", "naive"):
        d = s[name]
        lines.append(f"{name:<8} mean interaction within towers {d['within_tower_interaction']:.4f}, across "
                     f"{d['cross_tower_interaction']:.4f}")
    if s["tables_split_across_towers"]:
        lines.append(f"note: tables {', '.join(s['tables_split_across_towers'])} are read by features in different "
                     "towers; a distributed DMT run needs them in one tower group")
    lines.append("written: " + ", ".join(s["written"].values()))
    lines.append(f"train with it: --model-tower-assignment {s['written']['assignment']}")
    return "\n".join(lines)

