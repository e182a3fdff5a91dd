"""The address map (one packed code per row): bytes per row per rank and the decode time of a batch, against the map
as it was before (commit ``BASELINE_COMMIT``'s ``embedding/address_map.py``, loaded from ``git show`` of that
commit: owner int32 + owner offset int64 + replica slot int64 per row in numpy, and a torch copy with an int64
code and an int64 slot per row, 36 bytes per row per rank process).

Decode: criteo-kaggle's 26 tables (``--max-rows`` caps them; default uncapped, 33.8M rows), the 4-rank OPER
training plan of a Zipf(``--alpha``) profile (``plan.api.make_plan("oper")``, 5% extra memory: a replicated
hot head), batches of 4096 x 26 ids drawn from the same power law (the profile's rank -> row bijection, so
the hot rows are the replicated ones), decoded on rank 1. Three operations, each old and new on the same
batch, interleaved round by round (``--rounds``, batches rotating):

* ``codes``: the packed ``src << 40 | offset`` (+ replica bit) of every id (old: one int64 gather);
* ``decode``: ``(src, offset, replica slot)`` of every id (``TorchAddressMap.decode``: the send design and the
  PGAS lookups);
* ``remote_rows``: the retrieve design's whole index conversion (OPER 5.1: codes, local/remote split, the
  sorted unique remote rows, per-rank counts; ``embedding.retrieve.remote_rows`` on either map).

Bytes: every numpy array and torch tensor a rank process holds for the map (``AddressMap`` + its rank's
``TorchAddressMap``, each buffer counted once: on the CPU the torch view shares the numpy codes), per row of
all tables, for criteo-kaggle (old and new, both built) and for the criteo-terabyte preset's tables (187.8M
rows, the 4-rank OPER plan; new built and measured, old computed from its dtypes: building it would take
6.8 GB per rank process).

Times are this thread's CPU time (``time.thread_time``: on a 2-core machine shared by other jobs wall time
measures the load more than the code) and wall time, both reported. Prints one JSON line: figure = median
``remote_rows`` CPU ms (new), baseline = the old map's, ratio = new / old (below 1: faster), with medians and
p90 of every operation, bytes per row, load averages.

    nice -n 15 .venv/bin/python benchmarks/bench_address_map.py [--rounds 40] [--max-rows 0] [--no-terabyte]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embedscale.embedding.address_map import TorchAddressMap, address_map_from_plan
from embedscale.embedding.retrieve import remote_rows
from embedscale.plan.api import make_plan
from embedscale.plan.synthetic_profile import ZipfProfile, rank_to_row_bijection
from embedscale.specs import CRITEO_KAGGLE_ROWS, CRITEO_TERABYTE_ROWS, TableSpec, Topology

ROOT = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "5af841e"  # main before the packed map: the per-row address map (36 bytes per row per rank)
CRITEO_KAGGLE_SAMPLES = 45_840_617


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_baseline():
    """The old ``embedding/address_map.py`` as a module of its own (it imports only errors and specs)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE_COMMIT}:src/embedscale/embedding/address_map.py"],
                         check=True, capture_output=True).stdout
    d = Path(tempfile.mkdtemp(prefix="bench_address_map_"))
    path = d / "baseline_address_map.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("baseline_address_map", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def held_bytes(*objs) -> int:
    """Bytes of every numpy array and torch tensor the objects hold, each buffer counted once."""
    seen: dict[int, int] = {}
    for obj in objs:
        for v in vars(obj).values():
            if isinstance(v, np.ndarray):
                p = v.__array_interface__["data"][0]
                seen[p] = max(seen.get(p, 0), v.nbytes)
            elif isinstance(v, torch.Tensor):
                p = v.untyped_storage().data_ptr()
                seen[p] = max(seen.get(p, 0), v.untyped_storage().nbytes())
    return sum(seen.values())


def zipf_batch(rng, tables, alpha: float, batch: int, seed: int = 0) -> torch.Tensor:
    """``batch`` ids per table, popularity rank ~ Zipf(alpha) truncated to the table, mapped to rows by the
    profile's bijection (so they hit the rows the plan replicated), as global ids."""
    out, base = [], 0
    for i, t in enumerate(tables):
        n = t.num_rows
        r = np.zeros(0, dtype=np.int64)
        while r.size < batch:
            x = rng.zipf(alpha, 2 * batch)
            r = np.concatenate([r, x[x <= n][: batch - r.size]])
        a, b = rank_to_row_bijection(n, seed, i)
        out.append(base + (a * (r - 1) + b) % n)
        base += n
    return torch.from_numpy(np.concatenate(out).astype(np.int64))


class OldCodes:
    """The old map behind ``remote_rows``'s one call (``codes``): its code table, gathered."""

    def __init__(self, tm):
        self.tm = tm
        self.REPLICA, self.KEY_MASK, self.SHIFT, self.OFF_MASK = tm.REPLICA, tm.KEY_MASK, tm.SHIFT, tm.OFF_MASK

    def codes(self, gids):
        return self.tm.code.index_select(0, gids)


def stats(xs: list[float]) -> dict:
    return {"median_ms": round(float(np.median(xs)) * 1e3, 4), "p90_ms": round(float(np.percentile(xs, 90)) * 1e3, 4)}


def decode_part(args, old) -> dict:
    cap = args.max_rows or None
    tables = [TableSpec(f"C{i + 1}", min(n, cap) if cap else n, dim=16) for i, n in enumerate(CRITEO_KAGGLE_ROWS)]
    G = sum(t.num_rows for t in tables)
    prof = ZipfProfile.from_tables(tables, alpha=args.alpha, samples=CRITEO_KAGGLE_SAMPLES)
    t0 = time.perf_counter()
    plan = make_plan("oper", tables, prof, Topology(ranks_per_host=args.world), mode="training", extra_memory=0.05,
                     batch_size=args.batch)
    log(f"kaggle: {G} rows, oper plan in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    amap = address_map_from_plan(plan, tables)
    tm = TorchAddressMap(amap, args.rank)
    new_s = time.perf_counter() - t0
    new_bytes = held_bytes(amap, tm)
    t0 = time.perf_counter()
    old_amap = old.address_map_from_plan(plan, tables)
    old_tm = old.TorchAddressMap(old_amap, args.rank)
    old_s = time.perf_counter() - t0
    old_bytes = held_bytes(old_amap, old_tm)
    log(f"kaggle maps: new {new_bytes / G:.2f} B/row ({new_s:.1f} s), old {old_bytes / G:.2f} B/row ({old_s:.1f} s), "
        f"{amap.num_slots} replicated rows, row codes {amap.row_code.dtype}")
    rng = np.random.default_rng(0)
    batches = [zipf_batch(rng, tables, args.alpha, args.batch) for _ in range(args.batches)]
    oc = OldCodes(old_tm)
    def unpack(m, c):  # each map packs in its own layout: compare (src, offset, replica)
        return (c & m.KEY_MASK) >> m.SHIFT, c & m.OFF_MASK, (c & m.REPLICA) != 0

    for g in batches:  # the same answers before anything is timed
        for x, y in zip(unpack(oc, oc.codes(g)), unpack(tm, tm.codes(g))):
            assert torch.equal(x, y), "codes differ"
        for x, y in zip(old_tm.decode(g), tm.decode(g)):
            assert torch.equal(x, y), "decode differs"
        ro, rn = remote_rows(oc, g, args.rank, args.world), remote_rows(tm, g, args.rank, args.world)
        for i in (2, 3, 5):  # remote, ridx, rinv
            assert torch.equal(ro[i], rn[i]), "remote_rows differs"
        assert ro[6] == rn[6], "remote_rows counts differ"
        for x, y in zip(unpack(oc, ro[4]), unpack(tm, rn[4])):
            assert torch.equal(x, y), "remote_rows' unique rows differ"
    rep_share = float(np.mean([(tm.codes(g) >= tm.REPLICA).float().mean().item() for g in batches]))
    ops = {
        "codes": (lambda g: oc.codes(g), lambda g: tm.codes(g)),
        "decode": (lambda g: old_tm.decode(g), lambda g: tm.decode(g)),
        "remote_rows": (lambda g: remote_rows(oc, g, args.rank, args.world),
                        lambda g: remote_rows(tm, g, args.rank, args.world)),
    }
    times = {f"{op}_{w}": [] for op in ops for w in ("old", "new")}
    cpu = {k: [] for k in times}  # this thread's CPU time: what the load of other jobs disturbs least
    loads = []
    for r in range(args.rounds):
        g = batches[r % len(batches)]
        for op, (fo, fn) in ops.items():
            pair = [("old", fo), ("new", fn)] if r % 2 == 0 else [("new", fn), ("old", fo)]
            for who, f in pair:
                c, t = time.thread_time(), time.perf_counter()
                f(g)
                times[f"{op}_{who}"].append(time.perf_counter() - t)
                cpu[f"{op}_{who}"].append(time.thread_time() - c)
        if r % 10 == 0:
            loads.append(os.getloadavg()[0])
    return {"rows": G, "replicated_rows": amap.num_slots, "replicated_share_of_lookups": round(rep_share, 4),
            "row_code_dtype": str(amap.row_code.dtype),
            "bytes_per_row": {"new": round(new_bytes / G, 3), "old": round(old_bytes / G, 3)},
            "build_s": {"new": round(new_s, 2), "old": round(old_s, 2)},
            "cpu_times": {k: stats(v) for k, v in cpu.items()},
            "wall_times": {k: stats(v) for k, v in times.items()},
            "ratio_new_over_old_cpu": {op: round(float(np.median(cpu[f"{op}_new"]) / np.median(cpu[f"{op}_old"])), 3)
                                       for op in ops},
            "ratio_new_over_old_wall": {op: round(float(np.median(times[f"{op}_new"]) / np.median(times[f"{op}_old"])),
                                                  3) for op in ops},
            "load_during": [round(x, 2) for x in loads]}


def terabyte_part(args) -> dict:
    tables = [TableSpec(f"C{i + 1}", n, dim=64) for i, n in enumerate(CRITEO_TERABYTE_ROWS)]
    G = sum(t.num_rows for t in tables)
    prof = ZipfProfile.from_tables(tables, alpha=args.alpha, samples=4_373_472_329)
    t0 = time.perf_counter()
    plan = make_plan("oper", tables, prof, Topology(ranks_per_host=args.world), mode="training", extra_memory=0.05,
                     batch_size=args.batch)
    plan_s = time.perf_counter() - t0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    amap = address_map_from_plan(plan, tables)
    tm = TorchAddressMap(amap, args.rank)
    build_s = time.perf_counter() - t0
    b = held_bytes(amap, tm)
    W, S = args.world, amap.num_slots
    # the old map's arrays: numpy owner int32, owner offset int64, replica slot int64 per row; replica gid int64,
    # local and fetch int64 [S, W]; torch code and slot int64 per row, the rank's replica_local int64 [S]
    old_b = G * (4 + 8 + 8 + 8 + 8) + S * (8 + 16 * W + 8) + 8 * (len(tables) + 1) * 2 + 8 * W
    log(f"terabyte: {G} rows, oper plan {plan_s:.1f} s, map built in {build_s:.1f} s: {b / G:.3f} B/row "
        f"({b / 2**30:.2f} GiB), {S} replicated rows; old layout {old_b / G:.2f} B/row ({old_b / 2**30:.2f} GiB)")
    return {"rows": G, "replicated_rows": S, "row_code_dtype": str(amap.row_code.dtype),
            "bytes_per_row": round(b / G, 3), "gib_per_rank": round(b / 2**30, 3),
            "old_bytes_per_row_computed": round(old_b / G, 3), "old_gib_per_rank_computed": round(old_b / 2**30, 3),
            "plan_s": round(plan_s, 1), "build_s": round(build_s, 1),
            "peak_rss_gib_before_map": round(rss0, 2),
            "peak_rss_gib_after_map": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--max-rows", type=int, default=0, help="cap criteo-kaggle's tables (0: uncapped)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-terabyte", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    old = load_baseline()
    dec = decode_part(args, old)
    tb = None if args.no_terabyte else terabyte_part(args)
    fig, base = dec["cpu_times"]["remote_rows_new"]["median_ms"], dec["cpu_times"]["remote_rows_old"]["median_ms"]
    out = {"benchmark": "address_map", "figure": fig, "baseline": base, "ratio": round(fig / base, 3),
           "unit": "CPU ms per 4096 x 26 batch (remote_rows: ids -> codes -> remote dedup), new vs old map",
           "median": fig, "p90": dec["cpu_times"]["remote_rows_new"]["p90_ms"],
           "baseline_p90": dec["cpu_times"]["remote_rows_old"]["p90_ms"],
           "decode": dec, "terabyte": tb,
           "bar": {"bytes_per_row_at_most": 8.0,
                   "met_bytes": (tb or {}).get("bytes_per_row", dec["bytes_per_row"]["new"]) <= 8.0},
           "config": {"world": args.world, "rank": args.rank, "alpha": args.alpha, "batch": args.batch,
                      "tables": 26, "max_rows": args.max_rows, "rounds": args.rounds, "threads": args.threads,
                      "baseline_commit": BASELINE_COMMIT, "cpus": os.cpu_count(), "seconds": round(time.perf_counter() - t0, 1),
                      "loadavg_start": [round(x, 2) for x in load0],
                      "loadavg_end": [round(x, 2) for x in os.getloadavg()]}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
