"""Click logs -> shards: throughput per core and peak memory of the schema-driven reader (``data.tabular``)
on CSV and on Parquet, against the Criteo reader as it was before it became a schema of that reader
(commit ``BASELINE_COMMIT``, run from a ``git archive`` of that commit), on the same rows, same run,
interleaved (baseline, CSV, Parquet, Criteo preset; ``--rounds`` times).

The input is the real 10k-row Kaggle sample repeated to ``--mb`` MB of TSV (default 200: the machine is
shared; the issue's bar names 1 GB), the same rows as comma-separated CSV with a header (read with a
user's schema: float dense columns through log1p, string categorical keys, i.e. the defaults a user
gets) and as Parquet (dense int64, categorical strings; row groups of 64k rows). Every conversion runs
in a child process so its peak RSS (``ru_maxrss`` from ``wait4``) is its own. Hash mode with 1M rows per
table (one pass, as the baseline's default). MB are the rows' TSV bytes for every format (the Parquet
file is smaller; its size is reported). The figure is MB per CPU second of the conversion (all its
threads): MB/s per busy core. Wall-clock MB/s per core (MB / wall s / 2 threads, the figure of earlier
runs: 43-59 for the baseline on 1 GB) is reported too, but on a machine shared by other jobs it measures
the load more than the reader. Prints one JSON line on stdout.

    .venv/bin/python benchmarks/bench_reader.py [--mb 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT.parent / "shared/data/criteo_kaggle_head10k.tsv"
BASELINE_COMMIT = "f187fb2"  # main before the schema-driven reader: the hand-written Criteo reader (data/raw.py, criteo.py)
BAR_PEAK_MIB = 2048.0
TABLE_ROWS = 1_000_000


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_inputs(d: Path, target_bytes: int) -> tuple[Path, Path, Path, int]:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    sample = SAMPLE.read_bytes()
    copies = max(1, round(target_bytes / len(sample)))
    tsv, csv, parquet = d / "criteo.tsv", d / "criteo.csv", d / "criteo.parquet"
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    with open(tsv, "wb") as f:
        for _ in range(copies):
            f.write(sample)
    with open(csv, "wb") as f:
        f.write(",".join(names).encode() + b"\n")
        body = sample.replace(b"\t", b",")
        for _ in range(copies):
            f.write(body)
    types = {"label": pa.int8(), **{f"I{i}": pa.int64() for i in range(1, 14)},
             **{f"C{i}": pa.string() for i in range(1, 27)}}
    one = pacsv.read_csv(SAMPLE, read_options=pacsv.ReadOptions(column_names=names),
                         parse_options=pacsv.ParseOptions(delimiter="\t"),
                         convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True))
    with pq.ParquetWriter(parquet, one.schema) as w:
        for _ in range(copies):
            w.write_table(one, row_group_size=65_536)
    return tsv, csv, parquet, copies * len(sample)


def csv_schema():
    from embedscale.data.schema import Schema

    return Schema.from_dict({
        "format": "csv", "label": "label",
        "dense": [{"column": f"I{i}", "transform": "log1p"} for i in range(1, 14)],
        "sparse": [f"C{i}" for i in range(1, 27)]})


def child(args: argparse.Namespace) -> None:
    import resource

    if args.mode == "baseline":
        sys.path.insert(0, args.baseline_src)
    from embedscale.data import criteo

    assert args.mode != "baseline" or criteo.__file__.startswith(args.baseline_src), criteo.__file__
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if args.mode in ("baseline", "criteo"):
        m = criteo.convert_criteo(args.input, args.out, table_rows=TABLE_ROWS, progress=False)
    else:
        from embedscale.data.schema import Schema
        from embedscale.data.tabular import convert

        schema = csv_schema()
        if args.mode == "parquet":
            schema = Schema.from_dict({**schema.to_dict(), "format": "parquet", "name": "parquet"})
        m = convert(schema, args.input, args.out, table_rows=TABLE_ROWS, progress=False)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "rows": m.rows}))


def run_child(mode: str, inp: Path, out: Path, baseline_src: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--input", str(inp), "--out", str(out),
           "--baseline-src", str(baseline_src)]
    env = dict(os.environ)
    if mode == "baseline":
        env["PYTHONPATH"] = str(baseline_src)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"bench_reader: {mode} conversion failed (status {status})")
    r = json.loads(text.decode().strip().splitlines()[-1])
    r["peak_mib"] = usage.ru_maxrss / 1024
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="MB of TSV rows (the issue's bar: 1000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-src", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not SAMPLE.exists():
        sys.exit(f"bench_reader: the real Criteo sample is not at {SAMPLE} (see shared/data/README.md)")
    import pyarrow as pa

    load_start = os.getloadavg()
    threads = min(pa.cpu_count(), os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="bench_reader-") as tmp:
        tmp = Path(tmp)
        base_src = tmp / "baseline"
        base_src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE_COMMIT, "src/embedscale"],
                                 capture_output=True, check=True).stdout
        archive_path = tmp / "baseline.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as t:
            t.extractall(base_src, filter="data")
        base_src = base_src / "src"
        tsv, csv, parquet, size = make_inputs(tmp, int(args.mb * 1e6))
        log(f"input: {size / 1e6:.0f} MB of TSV rows; CSV {csv.stat().st_size / 1e6:.0f} MB, "
            f"Parquet {parquet.stat().st_size / 1e6:.0f} MB")
        runs: dict[str, list[dict]] = {m: [] for m in ("baseline", "csv", "parquet", "criteo")}
        inputs = {"baseline": tsv, "csv": csv, "parquet": parquet, "criteo": tsv}
        loads = []
        for r in range(args.rounds):
            for mode in runs:
                out = tmp / f"out-{mode}"
                res = run_child(mode, inputs[mode], out, base_src)
                res["mb_s_per_core"] = size / 1e6 / res["seconds"] / threads
                res["mb_per_cpu_s"] = size / 1e6 / res["cpu_seconds"]
                runs[mode].append(res)
                loads.append(os.getloadavg()[0])
                log(f"round {r + 1} {mode}: {res['mb_s_per_core']:.1f} MB/s per core, "
                    f"{res['mb_per_cpu_s']:.1f} MB per CPU s, peak {res['peak_mib']:.0f} MiB")
                subprocess.run(["rm", "-rf", str(out)], check=True)

    def summary(mode: str) -> dict:
        xs = sorted(x["mb_s_per_core"] for x in runs[mode])
        cs = sorted(x["mb_per_cpu_s"] for x in runs[mode])
        return {"median": round(statistics.median(xs), 2), "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2),
                "mb_per_cpu_s_median": round(statistics.median(cs), 2),
                "mb_per_cpu_s_p90": round(cs[min(len(cs) - 1, int(0.9 * len(cs)))], 2),
                "peak_rss_mib": round(max(x["peak_mib"] for x in runs[mode]), 1), "rows": runs[mode][0]["rows"]}

    s = {m: summary(m) for m in runs}
    base = s["baseline"]["mb_per_cpu_s_median"]
    ours = {m: s[m]["mb_per_cpu_s_median"] for m in ("csv", "parquet", "criteo")}
    print(json.dumps({
        "benchmark": "reader",
        "figure": ours,
        "baseline": base,
        "ratio": {m: round(ours[m] / base, 2) for m in ours},
        "unit": "MB per CPU second (TSV bytes of the rows / (user + sys) CPU s of the conversion): MB/s per busy "
                "core, which a shared machine does not distort as it does wall time",
        "wall_mb_s_per_core": {m: {"median": s[m]["median"], "p90": s[m]["p90"]} for m in s},
        "runs": s,
        "meets_bar": bool(all(ours[m] >= base for m in ("csv", "parquet"))
                          and all(s[m]["peak_rss_mib"] < BAR_PEAK_MIB for m in s)),
        "config": {
            "load_average_at_start": [round(x, 2) for x in load_start],
            "load_average_1min_during": [round(min(loads), 2), round(max(loads), 2)],
            "input_mb": round(size / 1e6, 1), "rounds": args.rounds, "threads": threads, "cores": os.cpu_count(),
            "table_rows": TABLE_ROWS, "categorical": "hash",
            "baseline": f"convert_criteo of commit {BASELINE_COMMIT} (the Criteo reader before the schema-driven one) on the TSV",
            "csv": "tabular.convert, comma-separated with a header, dense parse float + log1p, string (FNV-1a) keys",
            "parquet": "tabular.convert on the same rows in Parquet (dense int64, categorical string)",
            "criteo": "convert_criteo now (the Criteo schema of the tabular reader) on the TSV",
            "peak_rss": "ru_maxrss of each conversion's child process",
        },
    }))


if __name__ == "__main__":
    main()
