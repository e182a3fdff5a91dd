"""Shared bits of the planner benchmarks (bench_plan_*.py): tables, profiles, one JSON line out."""

from __future__ import annotations

import json
import resource
import sys

from embedscale.plan.synthetic_profile import ZipfProfile
from embedscale.specs import CRITEO_KAGGLE_ROWS, TableSpec

CRITEO_KAGGLE_SAMPLES = 45_840_617  # rows of the Criteo Kaggle training file


def criteo_tables(dim: int = 16) -> list[TableSpec]:
    return [TableSpec(f"C{i + 1}", n, dim=dim) for i, n in enumerate(CRITEO_KAGGLE_ROWS)]


def criteo_profile(tables, alpha: float = 1.1, seed: int = 0) -> ZipfProfile:
    return ZipfProfile.from_tables(tables, alpha=alpha, samples=CRITEO_KAGGLE_SAMPLES, seed=seed)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def emit(benchmark: str, figure: float, baseline: float, unit: str, config: dict, **extra) -> None:
    ratio = figure / baseline if baseline else float("inf")
    out = {"benchmark": benchmark, "figure": figure, "baseline": baseline, "ratio": ratio, "unit": unit,
           "config": config, **extra}
    sys.stdout.write(json.dumps(out) + "\n")
