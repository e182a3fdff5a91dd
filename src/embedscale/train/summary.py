"""The run summary as the commands print it (``train``, ``run``): one line per part of the run.

No torch here: a launcher prints the summary its ranks wrote (``summary.json``) without loading them.
"""

from __future__ import annotations

import math


def _num(v) -> float:
    return math.nan if v is None else v


def _eval_line(d: dict) -> str:
    """AUC, logloss, NE and calibration of a summary's last (``eval_*``) or best evaluation."""
    return (f"AUC {_num(d.get('eval_auc')):.5f}  logloss {_num(d.get('eval_logloss')):.5f}  "
            f"NE {_num(d.get('eval_ne')):.5f}  calibration {_num(d.get('eval_calibration')):.4f}")


def _steady(st: dict) -> str:
    """The steady-state step of the summary's ``train_step_seconds`` (after the warm-up), or nothing."""
    if not st.get("steps"):  # no step after the warm-up (the median is then NaN)
        return ""
    return f"; steady step {st['median'] * 1e3:.1f} ms (p90 {st['p90'] * 1e3:.1f}) after {st['skipped']} warm-up steps"


def _progressive_what(pv: dict) -> str:
    """What the progressive window's figures are: held out only while its samples are in their first epoch."""
    first, last = pv.get("epochs") or (1, 1)
    if last <= 1:
        return "each scored before it was trained on"
    if first > 1:
        span = f"epoch {first}" if first == last else f"epochs {first}-{last}"
        return f"{span}, each scored after earlier epochs trained on it (not held out)"
    return f"epochs 1-{last}, those of epochs 2+ scored after earlier epochs trained on them (not all held out)"


def format_summary(s: dict) -> str:
    lines = [
        f"run directory      {s.get('run_dir')}",
        f"tables             {s.get('num_tables')} ({s.get('embedding_bytes', 0) / 2**20:,.1f} MiB of embeddings"
        + (f"; {s['host_tables']} in the host parameter server" if s.get("host_tables") else "")
        + (f"; {s['tt_tables']} TT-compressed, replicated on every rank" if s.get("tt_tables") else "") + ")",
        f"train              {s.get('steps')} steps, {s.get('samples'):,} samples, "
        f"{s.get('train_samples_per_s', math.nan):,.0f} samples/s" + _steady(s.get("train_step_seconds") or {}),
        f"train logloss      {s.get('train_logloss', math.nan):.5f}",
        (f"eval (last)        step {s.get('steps')}: " + _eval_line(s)
         + (f"   (teacher ceiling {s['teacher_auc']:.5f})" if not math.isnan(s.get("teacher_auc", math.nan)) else "")
         if s.get("eval_samples", 1) else "eval (last)        none (no eval split)"),
    ]
    pv = s.get("progressive") or {}
    if pv:
        lines.append(f"progressive        last {pv['samples']:,} samples, {_progressive_what(pv)}: AUC "
                     f"{_num(pv.get('auc')):.5f}  logloss {_num(pv.get('logloss')):.5f}  NE {_num(pv.get('ne')):.5f}")
    st = s.get("stream") or {}
    if st:
        pos = st.get("position") or {}
        lines.append(f"stream             {st.get('shards_read')} shard(s) read from {st.get('directory')}, ended by "
                     f"{st.get('end') or '-'}; next: shard {pos.get('shard', 0)} row {pos.get('row', 0)}")
    best = s.get("best") or {}
    if best:
        lines.append(f"eval (best)        step {best['step']}: " + _eval_line(best)
                     + (f"   ({best['checkpoint']})" if best.get("checkpoint") else ""))
    if s.get("stopped_early"):
        es = s.get("early_stopping") or {}
        lines.append(f"early stopping     stopped at step {s.get('steps')}: {es.get('patience')} evaluations without a "
                     f"better {es.get('metric')}")
    if s.get("world_size", 1) > 1:
        if "towers" in s:  # DMT: the tower transform, no plan
            lines.append(f"ranks              {s['world_size']} ({s.get('plan')})")
        else:
            lines.append(f"ranks              {s['world_size']} ({s.get('plan')} plan, {s.get('design')} design, "
                         f"{s.get('transport')} transport)")
        if "dob_lookup" in s:
            lines.append(f"plan balance       DoB lookup {s['dob_lookup']:.3f}, communication {s['dob_comm']:.3f}, "
                         f"memory {s['dob_memory']:.3f}")
        if "towers" in s:
            lines.append(f"towers             {s['num_towers']} over {s['topology_hosts']} host(s), compression ratio "
                         f"{s['compression_ratio']:.3g}, {s['cross_host_bytes_per_step'] / 1e6:,.3f} MB/step across hosts")
        pred = s.get("predicted_bytes_on_wire_per_step")
        in_a2a = s.get("grad_sync") == "alltoall"
        lines.append(f"bytes on wire      {s['embedding_bytes_on_wire_per_step'] / 1e6:,.3f} MB/step embeddings"
                     + (" incl. replica gradients" if in_a2a else "")
                     + (f" (predicted {pred / 1e6:,.3f})" if pred else "")
                     + ("" if in_a2a else f", {s.get('grad_sync_bytes_per_step', 0) / 1e6:,.3f} MB/step "
                        + ("dense gradient sync" if "towers" in s else "replica AllReduce")))
    if "wall_seconds" in s:
        lines.append(f"wall time          {s['wall_seconds']:.1f} s")
    return "\n".join(lines)
