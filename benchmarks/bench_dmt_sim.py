"""DMT at 16-512 GPUs, simulated (``embedscale.towers.simulator``): flat model parallelism, the tower
transform (SPTT) and the tower transform with tower modules, on V100, A100 and H100 (DMT Table 1), for
DLRM and DCN (DMT Figures 10 and 11).

All three are priced in the same run by the same model of the cluster (weak scaling, local batch 16K,
8 GPUs per host, collective efficiency falling with world size as DMT Figure 5; the module docstring of
the simulator lists every assumption). The headline: DMT-DLRM over flat DLRM at 512 A100 GPUs; the
config carries the whole grid and whether the speedup grows with scale (DMT Figure 10's trend).

Prints one JSON line on stdout; the grid as a markdown table on stderr.

    .venv/bin/python benchmarks/bench_dmt_sim.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from embedscale.towers.simulator import describe, sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="DLRM on A100 only")
    args = ap.parse_args()
    gpus = (16, 32, 64, 128, 256, 512)
    hw = ("A100",) if args.quick else ("V100", "A100", "H100")
    archs = ("dlrm",) if args.quick else ("dlrm", "dcn")
    rows = sweep(gpus, hw, archs)
    table = {}
    print("| arch | GPU | GPUs | flat ms | SPTT x | DMT x | TM over SPTT x |", file=sys.stderr)
    print("|---|---|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        table.setdefault(f"{r['arch']}/{r['hardware']}", {})[r["gpus"]] = {
            "speedup_sptt": round(r["speedup_sptt"], 3), "speedup_dmt": round(r["speedup_dmt"], 3),
            "speedup_tm_over_sptt": round(r["speedup_tm_over_sptt"], 3), "flat_ms": round(r["flat"]["total"] * 1e3, 3)}
        print(f"| {r['arch']} | {r['hardware']} | {r['gpus']} | {r['flat']['total'] * 1e3:.1f} | "
              f"{r['speedup_sptt']:.2f} | {r['speedup_dmt']:.2f} | {r['speedup_tm_over_sptt']:.2f} |", file=sys.stderr)
    growing = {k: all(a["speedup_dmt"] < b["speedup_dmt"] for a, b in zip(list(v.values()), list(v.values())[1:]))
               for k, v in table.items()}
    head = next(r for r in rows if r["arch"] == "dlrm" and r["hardware"] == "A100" and r["gpus"] == 512)
    first = next(r for r in rows if r["arch"] == "dlrm" and r["hardware"] == "A100" and r["gpus"] == 16)
    out = {
        "benchmark": "dmt_simulator",
        "figure": round(head["throughput"]["dmt"], 0),
        "baseline": round(head["throughput"]["flat"], 0),
        "ratio": round(head["speedup_dmt"], 3),
        "unit": "samples/s, DMT-DLRM vs flat DLRM, 512 A100 GPUs (simulated)",
        "config": {"speedup_dlrm_a100_16": round(first["speedup_dmt"], 3), "speedup_grows_with_scale": growing,
                   "grid": table, "components_512_a100_dlrm": {k: head[k] for k in ("flat", "sptt", "dmt")},
                   "flops_per_sample": head["flops_per_sample"], "compression_ratio": head["compression_ratio"],
                   "model": describe(), "loadavg": os.getloadavg()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
