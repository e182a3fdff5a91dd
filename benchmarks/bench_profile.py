"""Profile synthetic criteo-terabyte shards: AccessProfile.from_shards against a Counter baseline.

Claim: exact per-row access counts of 10M criteo-terabyte samples (26 tables, full
40M-row cardinalities, 188M rows in all) in at most 60 s with peak memory under 8 GiB.

The shards are generated once into a temporary directory (timed and reported on its own). The
profiling runs in a child process, which reports its own wall time and peak RSS (``ru_maxrss``).
Baseline, in the same run: the straightforward approach, ``collections.Counter`` per table over the
ids of a prefix of the data, extrapolated linearly to all samples (said so in ``config``); its counts
on the prefix are checked against ``AccessProfile`` on the same prefix.

Usage: ``.venv/bin/python benchmarks/bench_profile.py [--quick] [--samples N] [--workdir DIR]``.
``--quick`` runs 1M samples. Prints one JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from embedscale.data.profile import AccessProfile
from embedscale.data.shards import Columns, Manifest, read_shard
from embedscale.data.synthetic import generate_dataset
from embedscale.specs import SyntheticConfig

CHILD = r"""
import json, resource, sys, time
from embedscale.data.profile import AccessProfile
t = time.perf_counter()
prof = AccessProfile.from_shards(sys.argv[1], progress=True)
seconds = time.perf_counter() - t
print(json.dumps({
    "seconds": seconds,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "samples": prof.samples,
    "accesses": sum(prof.total(n) for n in prof.table_names),
    "rows": sum(prof.num_rows(n) for n in prof.table_names),
    "accessed_rows": sum(s["accessed_rows"] for s in prof.summary().values()),
    "count_bytes": sum(prof.counts(n).nbytes for n in prof.table_names),
}))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def counter_baseline(directory: Path, prefix: int) -> tuple[float, dict[str, Counter], object]:
    """Counter per table over the first ``prefix`` samples; returns (seconds, counters, the prefix columns)."""
    m = Manifest.load(directory)
    cols = read_shard(directory / m.shards[0]["file"], m.num_dense)
    n = min(prefix, cols.rows)
    ids = {name: np.asarray(v[:n]) for name, (v, _) in cols.sparse.items()}  # one-hot: one id per sample
    t = time.perf_counter()
    counters = {name: Counter(v.tolist()) for name, v in ids.items()}
    return time.perf_counter() - t, counters, (cols, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M samples instead of 10M")
    ap.add_argument("--samples", type=int, default=0, help="override the number of samples")
    ap.add_argument("--shard-rows", type=int, default=1_000_000)
    ap.add_argument("--baseline-prefix", type=int, default=200_000, help="samples the Counter baseline counts")
    ap.add_argument("--workdir", default=None, help="where the temporary shards go (default: system temp)")
    args = ap.parse_args()
    samples = args.samples or (1_000_000 if args.quick else 10_000_000)
    cfg = SyntheticConfig(preset="criteo-terabyte", max_rows=0)

    with tempfile.TemporaryDirectory(prefix="bench_profile_", dir=args.workdir) as tmp:
        data = Path(tmp) / "shards"
        log(f"generating {samples} criteo-terabyte samples into {data}")
        t = time.perf_counter()
        manifest = generate_dataset(cfg, data, samples, seed=0, shard_rows=args.shard_rows, progress=True)
        gen_seconds = time.perf_counter() - t
        log(f"generated in {gen_seconds:.1f} s; profiling in a child process")

        child = subprocess.run([sys.executable, "-c", CHILD, str(data)], stdout=subprocess.PIPE, text=True,
                               check=True)
        ours = json.loads(child.stdout.strip().splitlines()[-1])
        if ours["samples"] != samples:
            raise SystemExit(f"profile counted {ours['samples']} samples, expected {samples}")

        log(f"baseline: collections.Counter per table on the first {args.baseline_prefix} samples")
        base_seconds, counters, (cols, n) = counter_baseline(data, args.baseline_prefix)
        base_extrapolated = base_seconds * samples / n
        # the baseline and AccessProfile agree on the prefix
        check = AccessProfile({i.name: np.zeros(i.num_rows, np.uint32) for i in manifest.sparse}, 0)
        check.add(Columns(cols.labels[:n], cols.dense[:n], {k: (v[:n], l[:n]) for k, (v, l) in cols.sparse.items()}))
        for name, ctr in counters.items():
            c = check.counts(name)
            nz = np.flatnonzero(c)
            if dict(zip(nz.tolist(), c[nz].tolist())) != dict(ctr):
                raise SystemExit(f"AccessProfile and Counter disagree on table {name}")

    gib = ours["peak_rss_bytes"] / 2**30
    result = {
        "benchmark": "profile",
        "figure": round(ours["seconds"], 3),
        "baseline": round(base_extrapolated, 3),
        "ratio": round(base_extrapolated / ours["seconds"], 2),
        "unit": "s",
        "config": {
            "preset": cfg.preset,
            "max_rows": cfg.max_rows,
            "alpha": cfg.alpha,
            "samples": samples,
            "shard_rows": args.shard_rows,
            "shards": len(manifest.shards),
            "table_rows_total": ours["rows"],
            "accessed_rows": ours["accessed_rows"],
            "accesses": ours["accesses"],
            "count_bytes": ours["count_bytes"],
            "peak_rss_gib": round(gib, 3),
            "generation_seconds": round(gen_seconds, 3),
            "generation_samples_per_s": round(samples / gen_seconds),
            "teacher_auc": manifest.extra["teacher_auc"],
            "baseline_method": f"collections.Counter per table on the first {n} samples, "
                               f"extrapolated linearly to {samples} ({base_seconds:.3f} s measured)",
            "bar": "profiling <= 60 s and peak RSS < 8 GiB (10M samples)",
            "meets_bar": bool(ours["seconds"] <= 60 and gib < 8),
            "ratio_is": "baseline seconds / AccessProfile.from_shards seconds",
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
