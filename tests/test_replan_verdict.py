"""The check's verdict travels without a wait (``train.replan_lag`` > 0 on N ranks): rank 0's check thread sends it
when done, the other ranks posted its receive when the check started and take it at the verdict step, so they do
not wait there for rank 0 (2 gloo ranks, the drifting stream of tests/test_migrate.py: its check of step 4
re-plans).

Reference: the same run where rank 0 arrives at the verdict step late by a known delay (5 s, after its check is
done); a rank that waited for rank 0's broadcast there would spend the whole delay in the monitor. The re-plan's
step is the plain-Python model's (tests/test_replan_lag.py ``plan_in_force``)."""

from __future__ import annotations

import json

from embedscale.specs import to_dict
from embedscale.train.launch import spawn_local
from embedscale.train.replan import read_replans

from test_migrate import EVERY, drift_config, drift_data
from test_replan_lag import plan_in_force

W, LAG, STEPS, LATE_S, STEP_SLEEP_S = 2, 3, 8, 5.0, 1.0  # wide: the check may take seconds under load


def _late_rank(rank, world, cfg_dict, run_dir, out_path, late_s, step_sleep):
    """A rank of ``train_distributed`` logging, per step, its seconds in ``maybe_replan`` and the check step of the
    plan it trains under; every step sleeps ``step_sleep`` (the lag's steps outlast the check); rank 0 waits for
    its check's thread at the verdict step, then sleeps ``late_s`` before taking the verdict."""
    import time

    from embedscale.specs import RunConfig, from_dict
    from embedscale.train import replan
    from embedscale.train.distributed import DistributedRun
    from embedscale.train.ranks import train_distributed

    log, verdicts = [], {}  # per step: seconds in maybe_replan; at a verdict step: the verdict's part of it
    step_fn, monitor_fn, conclude = DistributedRun.train_step, replan.DriftMonitor.maybe_replan, \
        replan.DriftMonitor._conclude

    def maybe_replan(self, run):
        t0 = time.perf_counter()
        out = monitor_fn(self, run)
        log.append({"step": run.state.step, "monitor_s": time.perf_counter() - t0,
                    "plan_checked_at": int(run.plan.meta.get("replanned_at_step", 0))})
        return out

    def late_conclude(self, run, p):
        if rank == 0 and p.thread is not None:
            p.thread.join()  # the check is done (its verdict sent, if it travels ahead) ...
            time.sleep(late_s)  # ... and rank 0 arrives late
        step = p.apply_at
        out = conclude(self, run, p)
        verdicts.update({s: sec for s, part, sec in self.pause_parts if part == "verdict" and s == step})
        return out

    def train_step(self, batch):
        time.sleep(step_sleep)
        return step_fn(self, batch)

    replan.DriftMonitor.maybe_replan, replan.DriftMonitor._conclude = maybe_replan, late_conclude
    DistributedRun.train_step = train_step
    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"log": log, "verdict_s": verdicts}, f)
    return True


def test_the_other_ranks_take_the_verdict_without_waiting_for_rank_0(tmp_path):
    """Lag 3, a check every 4 steps, 8 steps of 1 s: the check of step 4 re-plans at step 7 (the model). Rank 0
    reaches step 7's verdict 5 s late; rank 1's wait for the verdict there stays far below that (it arrived when
    rank 0's check finished; the migration that follows is collective and meets rank 0 as a step would), and
    both ranks run step 7 under the new plan."""
    data = tmp_path / "data"
    drift_data(data)
    cfg = drift_config(tmp_path, data, replan_every=EVERY, replan_min_gain=0.0, replan_weigh_costs=False,
                       replan_lag=LAG, max_steps=STEPS)
    spawn_local(_late_rank, W, to_dict(cfg), str(tmp_path / "run"), str(tmp_path / "log"), LATE_S, STEP_SLEEP_S,
                timeout_s=600)
    rows = read_replans(tmp_path / "run")
    assert [(int(r["step"]), int(r["checked_at"])) for r in rows] == [(EVERY + LAG, EVERY)], rows
    want = plan_in_force(STEPS, EVERY, LAG, {EVERY})
    out = {r: json.loads(open(f"{tmp_path / 'log'}.{r}").read()) for r in range(W)}
    logs = {r: out[r]["log"] for r in range(W)}
    for r in range(W):
        got = [e["plan_checked_at"] for e in logs[r] if e["step"] < STEPS][:STEPS]
        assert got == want, (r, got, want)
    wait = out[1]["verdict_s"]
    assert list(wait) == [str(EVERY + LAG)] and wait[str(EVERY + LAG)] < LATE_S / 2, wait  # blocking: >= LATE_S
    assert {e["step"]: e["monitor_s"] for e in logs[0]}[EVERY + LAG] >= LATE_S  # the delay did happen
