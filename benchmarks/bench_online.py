"""Online training on a drifting stream (the bars of BENCHMARKS.md): a static plan, the drift monitor's live
re-plans (``train.replan_every``) and a plan made with hindsight for every window, in the same run.

Input: a :class:`~embedscale.data.drift_stream.DriftingStream` whose hot set rotates every ``--rotate`` steps
(200), written as a shard dataset in step order (row ids = the stream's id indices, new ids arriving every
step), so global batch ``s`` of the loader is the stream's step ``s``. Three :class:`DistributedRun` s are
built in every rank process, the same model and seed, each under its own plan:

* ``static``: the OPER plan of window 0's true profile (the shards present when the run starts), kept;
* ``online``: starts from the same plan, with the drift monitor on (``train.replan_every``, ``train.replan``):
  rolling profile, a check every N steps, a live migration when re-planning gains enough (to the incremental
  plan, ``plan.incremental``), rank 0 planning beside training for ``--lag`` steps (``train.replan_lag``;
  ``--compare-lag0``: a fourth run, ``online_lag0``, the same monitor waiting for each check, interleaved);
* ``hindsight``: at the first step of every window, moved (``train.replan.move_to_plan``, untimed: an oracle)
  to the OPER plan of that window's true profile.

Every step every run trains on the same batch, in an order drawn step by step (a permutation seeded by the step:
interleaved, the load the machine is under hits all runs alike, and every run follows every other equally
often); each timed step starts after a barrier; a step's time is the slowest rank's. Each run's input pipeline
is driven as the training loop drives it (the next batch handed over before each step, where the run does not hold
it back; hindsight's kept before it moves to a window's plan). The online run's check and
migration are timed apart from its step (``maybe_replan`` is called first).

Figures (one JSON line per world size), windows 1.. (window 0 is where every plan is the hindsight one; its
paired step ratios, ``window0_paired_median``, are the comparison's own noise and overhead):

1. lookup DoB (``plan.cost``: min / max over ranks of eq. 2's lookup) on each window's true access profile:
   the static plan's; the online run's as it ran (each plan it held, on the steps it held it, summed per
   rank: its lag after a rotation counts) and the plan it held at the window's end; the hindsight plan's.
   Bar: static < 0.8 while online >= 0.95.
2. step time per window, median (p90) of the slowest rank, online against hindsight (and static): the
   median of the per-step ratios (each step's runs ran back to back: the load drifts less within a pair)
   and the ratio of medians; also online's mean with its checks and migrations spread over the steps.
   Bar: within 10% (on the paired median).
3. each migration (``train.replan.move_to_plan``: the map edited, rows and row-wise state moved in place)
   against the median online step; the whole re-plan pause (profile sum, rank 0's two plans, the migration)
   reported beside it.
   Bar: < 2 steps.
4. the online run's delta checkpoint (``train.checkpoint``): a full one at the start of window 1, a delta
   at the end of it (across its migrations); its rank files' bytes against the touched rows' bytes
   (distinct row ids of those steps, counted from the stream, times weight + row-wise state) plus the
   dense part (dense state and its optimizer state). Bar: <= 1.1x. (A full checkpoint's rank files also
   hold every rank's rolling profile, 8 bytes a row of every table, ``train.replan``; deltas do not.)

    nice -n 19 env PYTHONPATH=src .venv/bin/python benchmarks/bench_online.py [--quick] [--worlds 2,4]

5. each check's pause (``monitors``: the slowest rank's seconds in ``maybe_replan`` at the check's step and at
   each step its verdict was asked for, in median steps; ``max_one_step_steps`` the longest single one;
   ``pause_parts`` split into the check's start, the profiles' sum, the verdict and the migration; ``deferred``:
   verdicts asked for before the check was done, taken a period later) and the online run's steps plus pauses
   against the static plan's.
   Bars: the pause at most 1 step; online within 3% of static (on a stream where balance does not pay).
6. ``online_vs_static_rounds``: a fourth run, ``static_twin``, holds the static plan too (the same-plan pair: what
   two runs of the same code and plan differ by here, the comparison's noise floor). The steps are cut into rounds
   of ``--round-steps`` (20); each round's ratio is one run's seconds over static's in it (online: its steps and
   pauses); median, p10 and p90 over the rounds and the median's 95% interval (bootstrap over the rounds), for
   online / static and static_twin / static, in wall-clock seconds (the bar: the median within 3%) and in CPU
   seconds (every rank's step thread, and rank 0's check thread charged to its check's step: the work online
   adds, which a loaded machine's waits for a core hide in the wall clock); ``step_online_static_counted`` /
   ``_not_counted``: the per-step paired medians where the monitor counted the batch and where it did not;
   ``cpu_monitor_share``: the monitor's own CPU seconds (every rank's ``observe`` and ``maybe_replan``, rank 0's
   check thread) over static's, timed where the work runs (no second run's spread in it).

``--dob-only`` plans without training: the static plan's lookup DoB on each window, for any stream shape
(``--initial-ids``, ``--hot-ids``, ...): what bar 1 asks of the workload before any run.

``--link-gbit G [--link-latency-us L]``: a *simulated* network link per rank (``comm.hierarchical``: every rank its
own host, its embedding transport a ``HostAwareTransport`` whose ``LinkModel`` sleeps ``L + max(bytes sent,
received) * 8 / G`` after each exchange; the replicas' and the dense gradients' AllReduces charged to the same link
after each step), the same in every run (static, online, hindsight, static_twin): the wall time of communication
on ranks of separate machines, which ranks sharing this machine's cores cannot show. The plans and the monitor's
cost model see the same rate (``comm.hierarchical.link_topology``, ``dist.link_gbit_s``). ``--design send`` (the
owners pool, so a rank's link carries every access of the rows it serves) and ``--extra-memory`` (OPER's replica
budget) set every run's and plan's. JSON: ``config.link``, with each run's modelled link seconds a step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from embedscale.assemble import prepare_data, tables_for
from embedscale.comm.hierarchical import HostAwareTransport, LinkModel, link_topology
from embedscale.data.drift_stream import DriftConfig, DriftingStream
from embedscale.data.profile import AccessProfile
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.plan.api import make_plan
from embedscale.plan.cost import dob, evaluate
from embedscale.plan.forms import config_forms
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, Topology, from_dict, to_dict
from embedscale.train.checkpoint import base_ref, read_manifest
from embedscale.train.distributed import DistributedRun
from embedscale.train.launch import spawn_local
from embedscale.train.replan import QUIET_OBSERVE_PERIODS, counted_step, move_to_plan
from embedscale.train.run import dense_state, optimizer_state, save_checkpoint

RUNS = ("static", "online", "hindsight")
TWIN = "static_twin"  # a second run of the static plan: the same-plan pair (static_twin / static) is the noise floor
HAS_LAG = hasattr(RunConfig().train, "replan_lag")  # else: an earlier monitor (every check waits, lag 0)
LAG0 = "online_lag0"  # --compare-lag0: the monitor with train.replan_lag 0 (the other ranks wait for each check)
TABLES = ("C1", "C2", "C3", "C4")
DENSE = 4


def stream_config(a) -> DriftConfig:
    return DriftConfig(tables=TABLES, initial_ids=a.initial_ids, new_ids_per_step=a.new_ids, hot_ids=a.hot_ids,
                       hot_share=a.hot_share, hot_alpha=a.hot_alpha, rotate_every=a.rotate, batch_size=a.batch,
                       num_dense=DENSE)


def write_stream(path: Path, stream: DriftingStream, steps: int) -> dict[str, np.ndarray]:
    """The stream's first ``steps`` batches as a shard dataset (row ids = id indices); returns per table the
    ``[steps, batch]`` row ids (the true profile of any step range)."""
    rows = stream.universe_size(steps)
    idx = {t: [] for t in TABLES}
    with ShardWriter(path, [f"I{i}" for i in range(DENSE)], [SparseFeatureInfo(t, rows) for t in TABLES],
                     shard_rows=50 * stream.cfg.batch_size) as w:
        for s in range(steps):
            cols = stream.batch(s)
            ind = stream.batch_indices(s)
            w.write(cols.labels, cols.dense, ind)
            for t in TABLES:
                idx[t].append(ind[t])
    return {t: np.stack(v) for t, v in idx.items()}


def profile_of(idx: dict[str, np.ndarray], tables, a: int, b: int) -> AccessProfile:
    """The true access profile of steps ``[a, b)``, by table name (the run's tables read one feature each)."""
    counts = {}
    for spec in tables:
        (feat,) = spec.features
        counts[spec.name] = np.bincount(idx[feat][a:b].reshape(-1), minlength=spec.num_rows).astype(np.float64)
    return AccessProfile(counts, int(idx[TABLES[0]][a:b].size))


def run_config(a, root: Path, data: Path, name: str, world: int) -> RunConfig:
    return from_dict(RunConfig, {
        "name": name, "out_dir": str(root / "runs"),
        "data": {"source": "shards", "path": str(data), "eval_fraction": 0.0},
        "model": {"embedding_dim": a.dim, "bottom_mlp": [32], "top_mlp": [32]},
        "train": {"batch_size": a.batch, "max_steps": a.steps, "lr_dense": 0.05, "lr_sparse": 0.05, "log_every": 0,
                  "eval_every": 0, "checkpoint_every": 0, "sparse_optimizer": "rowwise_adagrad",
                  "dense_optimizer": "adagrad", "prefetch": 0, "seed": 0,
                  "replan_every": a.every if name.startswith("online") else 0, "replan_min_gain": a.min_gain,
                  **({"replan_lag": 0 if name == LAG0 else a.lag} if HAS_LAG else {}),
                  **({"replan_count_every": a.count_every} if a.count_every > 1 else {})},
        "dist": {"plan": "oper", "nproc": world, "timeout_s": 1800, **link_dist(a)}})


def plan_for(tables, forms, prof, world: int, batch: int, link_gbit: float = 0.0, traffic: str = "distinct",
             extra_memory: float = 0.05) -> Plan:
    plan = make_plan("oper", tables, prof, link_topology(Topology(ranks_per_host=world), link_gbit), forms=forms,
                     mode="training", extra_memory=extra_memory, batch_size=max(1, batch // world), traffic=traffic)
    plan.meta["forms"] = {n: f.to_dict() for n, f in forms.items()}
    return plan


# --link-gbit: a simulated network link per rank (comm.hierarchical), the same for every run ----------------------


def add_link_options(ap) -> None:
    ap.add_argument("--link-gbit", type=float, default=0.0,
                    help="every rank its own simulated network link of this many Gbit/s (one rank per host; 0 = none): "
                         "each exchange sleeps latency + max(bytes sent, received) * 8 / rate, in every run")
    ap.add_argument("--link-latency-us", type=float, default=0.0, help="the simulated link's latency per exchange")
    ap.add_argument("--design", default="retrieve", choices=("retrieve", "send"),
                    help="dist.design of every run (send: ids to the rows' owners, pooled sums back)")
    ap.add_argument("--extra-memory", type=float, default=0.05,
                    help="OPER's replica budget (dist.extra_memory) of every plan, the monitor's too (0: no replicas)")


def link_dist(a) -> dict:
    """The runs' ``dist`` settings of the link options: the design, and the link's rate for the monitor's costs."""
    return {"design": a.design, "extra_memory": a.extra_memory, **({"link_gbit_s": a.link_gbit} if a.link_gbit > 0
                                                                      else {})}


def plan_link(a) -> dict:
    """``plan_for``'s options: the link's rate in the plans' topology; the send design's traffic is every access."""
    return {"link_gbit": a.link_gbit, "traffic": "access" if a.design == "send" else "distinct",
            "extra_memory": a.extra_memory}


def link_job(a) -> dict | None:
    return {"gbit_s": a.link_gbit, "latency_us": a.link_latency_us} if a.link_gbit > 0 else None


def attach_link(run, link: dict) -> list:
    """Put ``run``'s embedding traffic on a simulated per-rank link (``HostAwareTransport``, one rank per host, a
    ``LinkModel`` of ``link``); the step's collectives outside that transport (the replicas' gradient AllReduce,
    counted by the executor, and the dense gradients' ring AllReduce, ``2 (W - 1) / W`` of their bytes) are charged
    to the same link after each step. Returns the list each step appends its modelled link seconds to."""
    model = LinkModel(link["gbit_s"], link["latency_us"])
    tr = HostAwareTransport(run.embedding.transport, list(range(run.world)), 1, model)
    run.embedding.transport = run.transport = tr
    run.embedding_env = replace(run.embedding_env, transport=tr)  # a module a re-plan builds talks through it too
    dense = sum(p.numel() * p.element_size() for p in run.model.dense_parameters())
    ring = 2 * (run.world - 1) * dense // run.world
    out, step = [], run.train_step

    def train_step(batch):
        t0 = tr.modelled_seconds
        loss = step(batch)
        sync = run.sync_bytes_per_step[-1] if run.sync_bytes_per_step else 0
        extra = model.seconds(ring, ring) + model.seconds(sync, sync)
        HostAwareTransport._sleep(extra)
        out.append(tr.modelled_seconds - t0 + extra)
        return loss

    run.train_step = train_step
    return out


def link_figures(a, res, K: int) -> dict | None:
    """The simulated link (JSON ``config.link``): its settings and, per run, the busiest rank's modelled link
    seconds per step (median after window 0; the step's exchanges and its AllReduces)."""
    if a.link_gbit <= 0:
        return None
    per = {n: np.max(np.stack([r["link_s"][n].numpy() for r in res]), axis=0) for n in res[0]["link_s"]}
    return {"simulated": "a network link per rank (comm.hierarchical.HostAwareTransport + LinkModel): every rank "
                         "its own host; each exchange sleeps latency + max(bytes sent, received) * 8 / rate",
            "gbit_s": a.link_gbit, "latency_us": a.link_latency_us, "hosts": "one per rank", "design": a.design,
            "extra_memory": a.extra_memory,
            "runs_on_the_link": sorted(per), "modelled_s_per_step_busiest_rank":
                {n: round(float(np.median(v[K:])), 6) for n, v in per.items()},
            "online_replans": [{"step": int(r["step"]), "predicted_gain": r["gain"], "reason": r["reason"]}
                               for r in res[0]["replans"]]}


def worker(rank, world, job):
    torch.set_num_threads(1)
    root, K, steps = Path(job["root"]), job["rotate"], job["steps"]
    names = tuple(job["cfg"])
    # a run built first and never stepped: the first run a process builds measured slower than a later one of
    # the same plan (about 2.5% CPU), so no timed run is the first
    first = DistributedRun(from_dict(RunConfig, job["cfg"]["static"]), root / "first-built", rank, world,
                           progress=False) if job.get("first_built") else None
    runs = {n: DistributedRun(from_dict(RunConfig, job["cfg"][n]), root / n, rank, world, progress=False)
            for n in names}
    runs_built_first = [first]  # kept to the end, never stepped
    link_s = {n: attach_link(r, job["link"]) for n, r in runs.items()} if job.get("link") else {}  # --link-gbit
    hind_plans = {int(w): Plan.load(p) for w, p in job["hindsight"].items()}
    step_s = {n: np.zeros(steps) for n in names}
    pause_s = {n: np.zeros(steps) for n in names if n.startswith("online")}  # maybe_replan: each step's pause
    replan_cpu = {n: np.zeros(steps) for n in names if n.startswith("online")}  # CPU seconds in maybe_replan
    cpu_s = {n: np.zeros(steps) for n in names}  # this rank's CPU seconds in each step (main thread; online:
    # its pause too, and rank 0's check thread charged to the check's step)
    losses = {n: [] for n in names}
    full_at, delta_at = K, 2 * K  # full checkpoint before step K, delta after step 2K - 1 (window 1)
    ckpt = {}
    online = runs["online"]
    observe_s = []  # the monitor's per-batch share of the online step (the rolling profile's update)
    observe_cpu = []  # the same in this thread's CPU seconds
    observe = online.monitor.observe

    counted = []  # per online step: whether observe counted the batch (else the decay alone: checks spaced out)

    def timed_observe(sparse, samples, reader=None):
        mon = online.monitor
        k = getattr(mon, "count_every", 1)
        counted.append(not mon._step < mon._quiet_until - QUIET_OBSERVE_PERIODS * mon.every
                       and (k == 1 or counted_step(mon._seed, mon._step, k)))
        t0, c0 = time.perf_counter(), time.thread_time()
        observe(sparse, samples, reader)
        observe_s.append(time.perf_counter() - t0)
        observe_cpu.append(time.thread_time() - c0)

    online.monitor.observe = timed_observe
    events = {n: _log_checks(runs[n].monitor) for n in pause_s}  # each check's steps: its start, its verdict tries
    check_cpu = {n: _time_checks(runs[n].monitor) for n in pause_s}  # rank 0: (check step, its thread's CPU s)
    it = iter(online.train_loader)
    upcoming = next(it)
    for s in range(steps):
        batch, upcoming = upcoming, (next(it) if s + 1 < steps else None)
        if s == 0 and rank == 0:  # the loader's global batch 0 is the stream's step 0 (rank 0's slice)
            (feat,) = online.tables[0].features
            got = batch.sparse.to_dict()[feat][0].cpu().numpy()
            assert np.array_equal(got, np.asarray(job["first_ids"])[:got.size]), "loader order != stream order"
        if s and s % K == 0:  # the oracle moves to this window's true plan at its first step (untimed)
            move_to_plan(runs["hindsight"], hind_plans[s // K])
        if s == full_at:
            online.state.step = s
            ckpt["full"] = str(save_checkpoint(online, track=True))
            for n in names:  # every run records its updated rows from here, as online must for its delta
                if n != "online":  # checkpoint (not online's own work: a static run with deltas does the same)
                    runs[n].embedding.track_touched()
        # the runs' order this step: a permutation drawn from the step (the same on every rank), so every run
        # follows every other one equally often (a fixed rotation gave each run the same predecessor and
        # measured the run after static up to 3% slower with the monitor switched off)
        for n in (names[i] for i in np.random.default_rng(s).permutation(len(names))):
            run = runs[n]
            run.state.step = s
            # the next batch to the run's input pipeline before this step, as the training loop hands it over
            # (held back where the run says so); hindsight's is kept before it moves to a window's plan
            if upcoming is not None and run.input_pipeline and not (n == "hindsight" and (s + 1) % K == 0):
                run.prefetch_batch(upcoming)
            dist.barrier()
            if n in pause_s:
                t0, c0 = time.perf_counter(), time.thread_time()
                run.monitor.maybe_replan(run)  # train_step's own call then returns at once (already checked)
                pause_s[n][s] = time.perf_counter() - t0
                cpu_s[n][s] += time.thread_time() - c0
                replan_cpu[n][s] = time.thread_time() - c0
                dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = run.train_step(batch)
            step_s[n][s] = time.perf_counter() - t0
            cpu_s[n][s] += time.thread_time() - c0
            losses[n].append(loss)
            run.state.losses.append(loss)
            run.state.step, run.state.samples = s + 1, run.state.samples + batch.global_size
        if s + 1 == delta_at and "full" in ckpt:
            d = save_checkpoint(online, base=base_ref(Path(ckpt["full"])))
            ckpt["delta"] = str(d)
            ckpt["delta_rows"] = int(online.embedding.shard_state(touched_only=True)["gids"].numel())
            ckpt["profile_bytes"] = int(sum(t.numel() * t.element_size() for t in online.monitor.state_dict().values()))
            if rank == 0:
                tensors = list(dense_state(online.model).values())
                for st in optimizer_state(online.opt, online._names).values():
                    tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
                ckpt["dense_bytes"] = int(sum(t.numel() * t.element_size() for t in tensors))
    dist.barrier()
    for n, got in check_cpu.items():
        for at, sec in got:
            cpu_s[n][at] += sec
    return {"step_s": {n: torch.from_numpy(v) for n, v in step_s.items()},
            "cpu_s": {n: torch.from_numpy(v) for n, v in cpu_s.items()},
            "check_cpu_s": {n: sum(sec for _, sec in got) for n, got in check_cpu.items()},
            "pause_s": {n: torch.from_numpy(v) for n, v in pause_s.items()},
            "losses": losses, "replans": online.monitor.records if rank == 0 else [],
            "declined": {n: runs[n].monitor.declined for n in pause_s},
            "deferred": {n: getattr(runs[n].monitor, "deferred", 0) for n in pause_s}, "events": events,
            "alarms": {n: getattr(runs[n].monitor, "alarms", 0) for n in pause_s},
            "pause_parts": {n: list(getattr(runs[n].monitor, "pause_parts", [])) for n in pause_s},
            "checks": online.monitor.checks, "ckpt": ckpt, "observe_s": torch.tensor(observe_s),
            "monitor_cpu_s": float(np.sum(observe_cpu) + replan_cpu["online"].sum()),
            "observe_cpu": torch.tensor(observe_cpu), "replan_cpu": torch.from_numpy(replan_cpu["online"]),
            "counted": torch.tensor(counted), "untimed_runs": sum(r is not None for r in runs_built_first),
            "link_s": {n: torch.tensor(v, dtype=torch.float64) for n, v in link_s.items()},
            # steps whose input was prepared ahead (online: since its last re-plan's new embedding)
            "prefetched_steps": {n: int(runs[n].embedding.stats.get("prefetched_steps", 0)) for n in names}}


def _time_checks(monitor) -> list[tuple[int, float]]:
    """Wrap ``monitor``'s check (rank 0's thread, ``DriftMonitor._decide``): the list it returns gets, per check,
    its step and the CPU seconds of its thread (its share of the cores, beside the ranks' steps)."""
    log: list[tuple[int, float]] = []
    decide = monitor._decide

    def _decide(run, p, t0):
        c0 = time.thread_time()
        try:
            return decide(run, p, t0)
        finally:
            log.append((p.step, time.thread_time() - c0))

    monitor._decide = _decide
    return log


def _log_checks(monitor) -> list[list[int]]:
    """Wrap ``monitor``'s check start and verdict: the list it returns gets, per check, the steps of its start
    and of every verdict broadcast (a check not ready at its verdict step is asked again a period later)."""
    log: list[list[int]] = []
    begin, conclude = monitor._begin, monitor._conclude

    def _begin(run, step):
        log.append([step])
        return begin(run, step)

    def _conclude(run, p):
        if log and log[-1][0] == p.step:
            log[-1].append(run.state.step)
        return conclude(run, p)

    monitor._begin, monitor._conclude = _begin, _conclude
    return log


def pauses(step: np.ndarray, pause: np.ndarray, every: int, lag: int, events=None) -> dict:
    """Each check's pause (the slowest rank's seconds in ``maybe_replan`` at the check's step and at each step its
    verdict was asked for, migration included) in the run's median steps; ``max_one_step_steps``: the longest
    single step's pause. Without ``events`` (an earlier monitor): the multiples of ``every`` and ``lag`` after."""
    med = float(np.median(step[1:]))
    if events is None:
        events = [[s] + ([s + lag] if lag and s + lag < len(pause) else []) for s in range(every, len(pause), every)]
    per = [float(sum(pause[s] for s in sorted(set(ev)))) for ev in events]
    inst = np.asarray(per or [0.0]) / med
    one = max((float(pause[s]) for ev in events for s in ev), default=0.0) / med
    return {"checks": len(per), "median_steps": round(float(np.median(inst)), 3),
            "p90_steps": round(float(np.percentile(inst, 90)), 3), "max_steps": round(float(inst.max()), 3),
            "max_one_step_steps": round(one, 3), "total_s": round(float(pause.sum()), 4),
            "deferred_verdicts": sum(max(0, len(ev) - 2) for ev in events)}


def pause_parts(per_rank: list, med: float) -> dict:
    """The pauses' parts (``DriftMonitor.pause_parts``: the check's start, the wait for the profiles' sum, the
    verdict's broadcast, the migration), the slowest rank's per occurrence, in median steps: median and max."""
    worst: dict[tuple[int, str], float] = {}
    who: dict[tuple[int, str], int] = {}  # the slowest rank of each
    for rank, parts in enumerate(per_rank):
        for step, name, sec in parts:
            if sec >= worst.get((step, name), 0.0):
                worst[(step, name)], who[(step, name)] = sec, rank
    out = {}
    for name in sorted({k[1] for k in worst}):
        v = np.asarray([s for k, s in worst.items() if k[1] == name]) / med
        top = sorted(((s, k[0], who[k]) for k, s in worst.items() if k[1] == name), reverse=True)[:3]
        out[name] = {"n": int(v.size), "median_steps": round(float(np.median(v)), 3),
                     "max_steps": round(float(v.max()), 3),
                     "largest": [{"step": st, "rank": r, "steps": round(s / med, 3)} for s, st, r in top]}
    return out


def against_static(step: dict, pause: dict, n: str, every: int, lag: int, events=None) -> dict:
    """Run ``n`` (steps and its monitor's pauses) against the static plan over the whole run: the ratio of total
    seconds, the median of the paired per-step ratios (each step's runs ran back to back), the pauses' share, and
    the steps that follow a check or a verdict (rank 0's check thread beside them) against the others."""
    on, st = step[n][1:] + pause[n][1:], step["static"][1:]
    s = np.arange(1, len(step[n]))
    checks = (s % every == 0) | ((s - lag) % every == 0) & (s > lag)
    if events is not None:  # the steps a check started or its verdict was asked for
        checks = np.isin(s, [x for ev in events for x in ev])
    return {"ratio_total": round(float(on.sum() / st.sum()), 4),
            "ratio_paired_median": round(float(np.median(on / st)), 4),
            "pause_share_of_static": round(float(pause[n][1:].sum() / st.sum()), 4),
            "step_ratio_at_checks": round(float(step[n][1:][checks].sum() / st[checks].sum()), 4) if checks.any()
            else None,
            "step_ratio_elsewhere": round(float(step[n][1:][~checks].sum() / st[~checks].sum()), 4),
            "paired_median_by_40_steps": [round(float(np.median(on[i:i + 40] / st[i:i + 40])), 3)
                                          for i in range(0, len(on), 40)]}


def rounds(on: np.ndarray, st: np.ndarray, size: int, seed: int = 0) -> dict:
    """Paired per-round ratios of two runs' seconds (``on`` / ``st``, step by step, the same steps): a round is
    ``size`` consecutive steps (every run took each of them back to back, in the step's drawn order), its ratio the
    sum of ``on`` over the sum of ``st``. Median, p10 and p90 over the rounds, the median's 95% interval (bootstrap over
    the rounds, 2,000 resamples), and the per-step paired median."""
    n = len(on) // size
    r = np.asarray([on[i * size:(i + 1) * size].sum() / st[i * size:(i + 1) * size].sum() for i in range(n)])
    rng = np.random.default_rng(seed)
    boot = np.median(r[rng.integers(0, n, size=(2000, n))], axis=1)
    return {"rounds": n, "round_steps": size, "median": round(float(np.median(r)), 4),
            "p10": round(float(np.percentile(r, 10)), 4), "p90": round(float(np.percentile(r, 90)), 4),
            "median_ci95": [round(float(np.percentile(boot, 2.5)), 4), round(float(np.percentile(boot, 97.5)), 4)],
            "median_ci95_width": round(float(np.percentile(boot, 97.5) - np.percentile(boot, 2.5)), 4),
            "per_step_paired_median": round(float(np.median(on / st)), 4), "ratio_total": round(float(on.sum()
                                                                                                    / st.sum()), 4)}


def monitor_parts(res: list, static_cpu: float) -> dict:
    """The monitor's own CPU seconds by part, summed over the ranks, as shares of static's CPU: ``observe`` of the
    batches counted and of those not counted, ``maybe_replan`` at the checks' starts, at their verdict steps and
    at the other steps, and rank 0's check thread."""
    counted = res[0]["counted"].numpy().astype(bool)
    ev = res[0]["events"]["online"]
    starts = np.isin(np.arange(len(counted)), [e[0] for e in ev])
    verdicts = np.isin(np.arange(len(counted)), [x for e in ev for x in e[1:]]) & ~starts
    obs = sum(r["observe_cpu"].numpy() for r in res)
    rep = sum(r["replan_cpu"].numpy() for r in res)
    parts = {"observe_counted": obs[counted].sum(), "observe_not_counted": obs[~counted].sum(),
             "check_start": rep[starts].sum(), "verdict": rep[verdicts].sum(),
             "other_steps": rep[~starts & ~verdicts].sum(), "check_thread": res[0]["check_cpu_s"]["online"]}
    out = {k: round(float(v / static_cpu), 5) for k, v in parts.items()}
    out["counted_batches"], out["checks"] = int(counted.sum()), len(ev)
    return out


def on_interval(r: dict, bar: float = 1.03) -> str:
    """The bar "at most ``bar``" judged on a :func:`rounds` median's 95% interval: ``met`` when its upper end is
    within the bar, ``missed`` when its lower end is beyond it, else ``unresolved`` (the interval straddles it)."""
    lo, hi = r["median_ci95"]
    return "met" if hi <= bar else "missed" if lo > bar else "unresolved"


def q(v) -> dict:
    v = np.asarray(v, dtype=np.float64)
    return {"median_s": round(float(np.median(v)), 6), "p90_s": round(float(np.percentile(v, 90)), 6)}


def lookup_bytes(plan: Plan, prof: AccessProfile, world: int, batch: int, steps: int) -> np.ndarray:
    """Lookup bytes per rank over ``steps`` steps of ``prof`` (eq. 2 per iteration, times the steps)."""
    c = evaluate(plan, prof, Topology(ranks_per_host=world), mode="training", batch_size=max(1, batch // world))
    return c.lookup_bytes_per_rank * steps


def replica_rows(plan: Plan) -> int:
    """Extra copies a plan stores (rows times holders beyond the owner)."""
    return int(((plan.holders.sum(axis=1) - 1) * plan.part_rows).sum())


def one_world(a, world: int, root: Path, data: Path, idx, stream) -> dict:
    root = root / f"w{world}"
    K, steps, W = a.rotate, a.steps, a.steps // a.rotate
    tmp_cfg = run_config(a, root, data, "static", world)
    prepared = prepare_data(tmp_cfg, progress=False)
    tables = tables_for(tmp_cfg, prepared.manifest)
    forms = config_forms(tmp_cfg.model, tables)
    wprof = [profile_of(idx, tables, w * K, (w + 1) * K) for w in range(W)]
    if a.dob_only:  # planning only: the static plan's lookup DoB on every window (no training)
        static = plan_for(tables, forms, wprof[0], world, a.batch, **plan_link(a))
        topo = Topology(ranks_per_host=world)
        dobs = [round(evaluate(static, wprof[w], topo, mode="training", batch_size=max(1, a.batch // world))
                      .dob_lookup, 4) for w in range(W)]
        return {"figure": "the static plan's lookup DoB per window (planning only)", "world": world,
                "dob_lookup_static": dobs, "mean_after_window0": round(float(np.mean(dobs[1:])), 4),
                "config": {"windows": W, "rotate_every": K, "initial_ids": a.initial_ids, "hot_ids": a.hot_ids,
                           "hot_share": a.hot_share, "hot_alpha": a.hot_alpha, "new_ids_per_step": a.new_ids, "batch_global": a.batch,
                           "tables": len(TABLES), "rows_per_table": stream.universe_size(steps)}}
    t0 = time.perf_counter()
    hind = [plan_for(tables, forms, wprof[w], world, a.batch, **plan_link(a)) for w in range(W)]
    plan_s = (time.perf_counter() - t0) / W
    cfgs = {}
    for n in RUNS + (TWIN,) + ((LAG0,) if a.compare_lag0 else ()):
        hind[0].save(root / n / "plan")  # every run starts from window 0's plan (the static plan)
        cfgs[n] = to_dict(run_config(a, root, data, n, world))
    for w in range(1, W):
        hind[w].save(root / "hindsight-plans" / f"w{w}")
    hind[0].save(root / "first-built" / "plan")
    job = {"root": str(root), "rotate": K, "steps": steps, "cfg": cfgs, "first_built": not a.no_first_built,
           "hindsight": {str(w): str(root / "hindsight-plans" / f"w{w}") for w in range(1, W)},
           "first_ids": idx[tables[0].features[0]][0].tolist(), "link": link_job(a)}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = spawn_local(worker, world, job, timeout_s=3600)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    step = {n: np.max(np.stack([r["step_s"][n].numpy() for r in res]), axis=0) for n in cfgs}
    pause = {n: np.max(np.stack([r["pause_s"][n].numpy() for r in res]), axis=0) for n in res[0]["pause_s"]}
    # online (steps and pauses) against static, and the same-plan pair (the noise floor), in paired rounds
    paired = {"online_static": rounds(step["online"][1:] + pause["online"][1:], step["static"][1:], a.round_steps),
              "noise_floor_static_twin_static": rounds(step[TWIN][1:], step["static"][1:], a.round_steps)}
    # the same in CPU seconds (every rank's main thread summed, and rank 0's check thread): the work each run adds,
    # which the machine's load (a rank waiting for a core) hides in the wall-clock figure
    cpu = {n: np.sum(np.stack([r["cpu_s"][n].numpy() for r in res]), axis=0) for n in cfgs}
    paired["cpu_online_static"] = rounds(cpu["online"][1:], cpu["static"][1:], a.round_steps)
    paired["cpu_noise_floor_static_twin_static"] = rounds(cpu[TWIN][1:], cpu["static"][1:], a.round_steps)
    # where a placement can pay on this machine: the busiest rank's share of the step's CPU (1 / world when
    # balanced) and the step a machine of --cores cores cannot beat, max(total / cores, the busiest rank's), per
    # run after window 0, against static's
    per_rank = {n: np.stack([r["cpu_s"][n].numpy() for r in res])[:, K:] for n in cfgs}
    bound = {n: np.maximum(v.sum(axis=0) / a.cores, v.max(axis=0)) for n, v in per_rank.items()}
    paired["cpu_busiest_rank_share"] = {n: round(float(np.median(v.max(axis=0) / v.sum(axis=0))), 4)
                                        for n, v in per_rank.items()}
    paired["cpu_bound_static_over_run"] = {n: round(float(np.median(bound["static"] / bound[n])), 4)
                                           for n in cfgs if n != "static"}
    paired["cpu_check_thread_share"] = round(float(res[0]["check_cpu_s"]["online"] / cpu["static"][1:].sum()), 5)
    # the monitor's own work, timed where it runs (every rank's observe and maybe_replan, rank 0's check thread)
    # against static's CPU: what online adds directly, without the run-to-run spread of two runs' totals
    mon_cpu = sum(r["monitor_cpu_s"] for r in res) + res[0]["check_cpu_s"]["online"]
    paired["cpu_monitor_share"] = round(float(mon_cpu / cpu["static"].sum()), 5)
    paired["cpu_monitor_parts"] = monitor_parts(res, cpu["static"].sum())
    if a.dump:  # every run's per-step seconds (the slowest rank's) and the online run's pauses, for a closer look
        np.savez(f"{a.dump}-w{world}.npz", **{f"step_{n}": v for n, v in step.items()},
                 **{f"cpu_{n}": v for n, v in cpu.items()},
                 **{f"pause_{n}": v for n, v in pause.items()}, counted=res[0]["counted"].numpy(),
                 order=np.array(list(cfgs)), check_steps=np.array([ev[0] for ev in res[0]["events"]["online"]]),
                 observe_s=np.max(np.stack([r["observe_s"].numpy() for r in res]), axis=0))
    # per-step paired medians (online's step alone) where the monitor counted the batch, and where it did not
    counted = res[0]["counted"].numpy().astype(bool)
    touched = np.isin(np.arange(a.steps), [x for ev in res[0]["events"]["online"] for x in ev])
    for name, sel in (("counted", counted & ~touched), ("not_counted", ~counted & ~touched)):
        sel[0] = False
        def med(x, y, sel=sel):
            return round(float(np.median(x[sel] / y[sel])), 4) if sel.any() else None

        paired[f"step_online_static_{name}"] = {
            "steps": int(sel.sum()), "paired_median": med(step["online"], step["static"]),
            "twin_paired_median": med(step[TWIN], step["static"]),
            "cpu_paired_median": med(cpu["online"], cpu["static"]),
            "cpu_twin_paired_median": med(cpu[TWIN], cpu["static"])}
    check = pause["online"]
    replans = res[0]["replans"]
    # the online run's plan timeline: (first step, plan)
    timeline = [(0, hind[0])] + [(int(r["step"]), Plan.load(root / "online" / "replans" / f"step-{r['step']}"))
                                 for r in replans]
    windows = []
    for w in range(1, W):
        a0, b0 = w * K, (w + 1) * K
        held = np.zeros(world)
        for i, (start, plan) in enumerate(timeline):
            stop = timeline[i + 1][0] if i + 1 < len(timeline) else steps
            lo, hi = max(start, a0), min(stop, b0)
            if lo < hi:
                held += lookup_bytes(plan, profile_of(idx, tables, lo, hi), world, a.batch, hi - lo)
        end_plan = [p for st, p in timeline if st < b0][-1]
        topo = Topology(ranks_per_host=world)
        ev = lambda p: evaluate(p, wprof[w], topo, mode="training", batch_size=max(1, a.batch // world))  # noqa: E731
        sl = slice(a0, b0)
        on_total = step["online"][sl] + check[sl]
        windows.append({
            "window": w,
            "dob_lookup": {"static": round(ev(hind[0]).dob_lookup, 4), "online_as_run": round(dob(held), 4),
                           "online_at_end": round(ev(end_plan).dob_lookup, 4),
                           "hindsight": round(ev(hind[w]).dob_lookup, 4)},
            "step": {n: q(step[n][sl]) for n in RUNS},
            "online_mean_with_checks_s": round(float(on_total.mean()), 6),
            "hindsight_mean_s": round(float(step["hindsight"][sl].mean()), 6),
            "ratio_online_hindsight_median": round(float(np.median(step["online"][sl])
                                                         / np.median(step["hindsight"][sl])), 4),
            "ratio_online_hindsight_paired_median": round(float(np.median(step["online"][sl]
                                                                          / step["hindsight"][sl])), 4),
            "ratio_static_hindsight_paired_median": round(float(np.median(step["static"][sl]
                                                                          / step["hindsight"][sl])), 4),
            "ratio_online_with_checks_hindsight_mean": round(float(on_total.mean()
                                                                  / step["hindsight"][sl].mean()), 4),
            "replica_rows": {"static": replica_rows(hind[0]), "online_at_end": replica_rows(end_plan),
                             "hindsight": replica_rows(hind[w])},
            "replans": sum(a0 <= int(r["step"]) < b0 for r in replans)})
    med_online = float(np.median(step["online"][K:]))
    migs = [{"step": int(r["step"]), "migrate_s": float(r["migrate_seconds"]), "pause_s": float(r["seconds"]),
             "rows_moved": int(r["rows_moved"]), "bytes": int(r["bytes"]),
             "migrate_in_steps": round(float(r["migrate_seconds"]) / med_online, 3),
             "pause_in_steps": round(float(r["seconds"]) / med_online, 3)} for r in replans]
    ck = res[0]["ckpt"]
    delta_bytes = sum(f.stat().st_size for f in Path(ck["delta"]).glob("rank-*.pt"))
    full_bytes = sum(f.stat().st_size for f in Path(ck["full"]).glob("rank-*.pt"))
    d_step, f_step = read_manifest(Path(ck["delta"]))["step"], read_manifest(Path(ck["full"]))["step"]
    touched = sum(int(np.unique(idx[t.features[0]][f_step:d_step]).size) for t in tables)
    row_bytes = a.dim * 4 + 4  # float32 weight + row-wise Adagrad state
    ref = touched * row_bytes + ck["dense_bytes"]
    static_dobs = [x["dob_lookup"]["static"] for x in windows]
    online_dobs = [x["dob_lookup"]["online_as_run"] for x in windows]
    ratios = [x["ratio_online_hindsight_paired_median"] for x in windows]
    monitors = {n: {"replan_lag": 0 if n == LAG0 else a.lag,
                    "pause": pauses(step[n], pause[n], a.every, 0 if n == LAG0 else a.lag, res[0]["events"][n]),
                    "vs_static": against_static(step, pause, n, a.every, 0 if n == LAG0 else a.lag,
                                                res[0]["events"][n]),
                    "declined": res[0]["declined"][n], "deferred": res[0]["deferred"][n],
                    "alarms": res[0]["alarms"][n],
                    "pause_parts": pause_parts([r["pause_parts"][n] for r in res], float(np.median(step[n][1:])))}
                for n in pause}
    return {
        "figure": "online training on a drifting stream: lookup DoB, step time, migration, delta checkpoint",
        "world": world,
        "bars": {
            "dob_static_below_0.8": all(d < 0.8 for d in static_dobs),
            "dob_online_at_least_0.95": all(d >= 0.95 for d in online_dobs),
            "step_online_within_10pct_of_hindsight": all(r <= 1.10 for r in ratios),
            "migration_below_2_steps": all(m["migrate_in_steps"] < 2 for m in migs),
            "delta_at_most_1.1x": delta_bytes / ref <= 1.10,
            "online_within_3pct_of_static": paired["online_static"]["median"] <= 1.03,
            "online_within_3pct_of_static_cpu": paired["cpu_online_static"]["median"] <= 1.03,
            # the verdict on the median's 95% interval, beside the same-plan pair's (the noise floor)
            "online_within_3pct_of_static_interval": on_interval(paired["online_static"]),
            "online_within_3pct_of_static_cpu_interval": on_interval(paired["cpu_online_static"]),
            "noise_floor_within_3pct_interval": on_interval(paired["noise_floor_static_twin_static"]),
            "noise_floor_within_3pct_cpu_interval": on_interval(paired["cpu_noise_floor_static_twin_static"]),
            "pause_at_most_1_step": monitors["online"]["pause"]["max_steps"] <= 1.0},
        "online_vs_static_rounds": paired,
        "monitors": monitors,
        "windows": windows,
        "dob_lookup_mean": {"static": round(float(np.mean(static_dobs)), 4),
                            "online_as_run": round(float(np.mean(online_dobs)), 4)},
        "step_median_after_window0": {n: q(step[n][K:]) for n in RUNS},
        "window0_paired_median": {  # every run holds the same plan in window 0: the order / run effect alone
            "online_hindsight": round(float(np.median(step["online"][1:K] / step["hindsight"][1:K])), 4),
            "static_hindsight": round(float(np.median(step["static"][1:K] / step["hindsight"][1:K])), 4)},
        "ratio_online_hindsight_after_window0": {
            "paired_median": round(float(np.median(step["online"][K:] / step["hindsight"][K:])), 4),
            "median": round(float(np.median(step["online"][K:]) / np.median(step["hindsight"][K:])), 4),
            "mean_with_checks_and_migrations": round(float((step["online"][K:] + check[K:]).mean()
                                                           / step["hindsight"][K:].mean()), 4)},
        "migrations": migs, "checks": res[0]["checks"],
        "prefetched_steps_rank0": res[0].get("prefetched_steps"),
        "observe_s_rank_max": q(np.max(np.stack([r["observe_s"].numpy() for r in res]), axis=0)),
        "observe_s_rank_max_counted": q(np.max(np.stack([r["observe_s"].numpy() for r in res]), axis=0)[
            res[0]["counted"].numpy().astype(bool)]),
        "check_s_without_replan": q([c for s, c in enumerate(check) if s and s % a.every == 0 and s not in
                                     {m["step"] for m in migs}] or [0.0]),
        "check_s_total": round(float(check.sum()), 4),
        "oper_plan_s_parent": round(plan_s, 4),
        "delta_checkpoint": {"full_step": f_step, "delta_step": d_step, "delta_bytes": delta_bytes,
                             "full_bytes": full_bytes, "touched_rows": touched,
                             "delta_rows_saved": sum(r["ckpt"]["delta_rows"] for r in res),
                             "row_bytes": row_bytes, "dense_bytes": ck["dense_bytes"],
                             "reference_bytes": ref, "ratio": round(delta_bytes / ref, 4),
                             "rolling_profile_bytes_in_full": sum(r["ckpt"].get("profile_bytes", 0) for r in res)},
        "final_loss": {n: round(float(np.mean(res[0]["losses"][n][-K:])), 5) for n in RUNS},
        "static_twin_same_losses": res[0]["losses"][TWIN] == res[0]["losses"]["static"],
        "wall_s": round(wall, 1), "load_average": [round(load0, 2), round(load1, 2)],
        "config": {"world": world, "steps": steps, "rotate_every": K, "tables": len(TABLES),
                   "rows_per_table": stream.universe_size(steps), "initial_ids": a.initial_ids,
                   "new_ids_per_step": a.new_ids, "hot_ids": a.hot_ids, "hot_share": a.hot_share, "hot_alpha": a.hot_alpha,
                   "batch_global": a.batch, "dim": a.dim, "replan_every": a.every, "replan_min_gain": a.min_gain,
                   "threads_per_rank": 1, "model": "dlrm bottom [32] top [32]", "plan": "oper",
                   "replan_lag": a.lag, "compare_lag0": a.compare_lag0, "replan_count_every": a.count_every,
                   "round_steps": a.round_steps,
                   "runs_interleaved": list(cfgs), "untimed_run_built_first": not a.no_first_built,
                   "online_plans": "incremental when within 2% of OPER's fresh plan (train.replan)",
                   "link": link_figures(a, res, K)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 windows of 40 steps (a smoke run, not the bars)")
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--rotate", type=int, default=200)
    ap.add_argument("--every", type=int, default=10, help="train.replan_every")
    ap.add_argument("--min-gain", type=float, default=0.05, help="train.replan_min_gain")
    ap.add_argument("--initial-ids", type=int, default=20_000)
    ap.add_argument("--new-ids", type=int, default=4)
    ap.add_argument("--hot-ids", type=int, default=8)
    ap.add_argument("--hot-share", type=float, default=0.8)
    ap.add_argument("--hot-alpha", type=float, default=0.0,
                    help="Zipf exponent over the hot set's members (0 = uniform draw)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lag", type=int, default=getattr(RunConfig().train, "replan_lag", 0),
                    help="train.replan_lag of 'online'")
    ap.add_argument("--count-every", type=int, default=1,
                    help="train.replan_count_every of the monitored runs (each batch counted with probability 1/k)")
    ap.add_argument("--compare-lag0", action="store_true",
                    help="a fourth run, 'online_lag0': the same monitor with train.replan_lag 0, interleaved")
    ap.add_argument("--round-steps", type=int, default=20,
                    help="steps per round of the paired online / static and static_twin / static ratios")
    ap.add_argument("--no-first-built", action="store_true",
                    help="time the first run the process builds (by default one more run is built first, not timed)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores the ranks share (the CPU bound of a step, cpu_bound_static_over_run)")
    ap.add_argument("--dump", default=None, help="save the per-step seconds to <dump>-w<world>.npz")
    ap.add_argument("--root", default=None, help="keep the runs here (default: a temporary directory)")
    add_link_options(ap)
    ap.add_argument("--dob-only", action="store_true",
                    help="plan only: the static plan's lookup DoB on every window, no training (bar 1's premise)")
    a = ap.parse_args()
    if a.quick:
        a.windows, a.rotate, a.every, a.batch = 3, 40, 10, 256
    a.steps = a.windows * a.rotate
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:
        stream = DriftingStream(stream_config(a), seed=0)
        data = root / "data"
        idx = write_stream(data, stream, a.steps)
        for world in (int(x) for x in a.worlds.split(",")):
            sys.stdout.write(json.dumps(one_world(a, world, root, data, idx, stream)) + "\n")
            sys.stdout.flush()
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
