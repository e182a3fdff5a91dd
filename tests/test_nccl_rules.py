"""Every collective of a sharded training step is one NCCL takes, checked on CPU over gloo.

``NcclRules`` wraps ``torch.distributed``'s collectives in a rank process (every call site of the library goes
through ``dist.<collective>``: the transports' all-to-alls and the replica gradient sync, the profile's and the
monitor's reductions alike) and checks each call against the rules of PyTorch's NCCL process group
(``ProcessGroupNCCL``: ``getNcclReduceOp``, its ``ncclDataType`` map), written out below as plain tables:

- reduce ops: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM; BAND, BOR and BXOR are rejected;
- dtypes: int8, uint8, int32, int64, float16, bfloat16, float32, float64, bool (sent as uint8) and the float8
  types; anything else (int16, uint16/32/64, complex) is rejected; a reduction of bool is rejected (older
  NCCL process groups have none, and its meaning per op is the backend's choice);
- ``gather`` and ``scatter`` are rejected (older NCCL process groups lack them; newer ones run them as
  point-to-point sends): a step gathers with ``all_gather`` and scatters with ``all_to_all``;
- a CUDA run's tensors are all on the accelerator (``device``): a host tensor handed to NCCL is rejected.

The call then runs on gloo as before, so a training step runs to its end and reports every violation it makes,
each with the collective and the library line that called it. The step tests run training steps of every
configuration a run can take (the retrieve and send designs, with and without prefetching, every replica
gradient sync, TT tables, host tables) on 2 gloo ranks and expect no violation at all (DDP's dense gradient
buckets are covered too: its comm hook calls ``dist.all_reduce``; only DDP's start-up broadcast of the dense
parameters goes from C++ to the process group, float tensors NCCL takes).
"""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.launch import spawn_local

R = dist.ReduceOp
NCCL_OPS = {R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.PREMUL_SUM}
NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
               torch.float64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz}
REDUCTIONS = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
REJECTED = {"gather", "scatter"}
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "gather", "scatter",
               "send", "recv", "isend", "irecv")
SRC = str(Path(__file__).resolve().parents[1] / "src" / "embedscale")

def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _caller() -> str:
    """``file.py:line`` of the innermost library frame (relative to the package) but the transport module's
    counted pass-throughs (``counted_all_reduce``, ...), else ``?``."""
    for fr in reversed(traceback.extract_stack()[:-3]):
        if fr.filename.startswith(SRC) and not fr.filename.endswith("comm/transport.py"):
            return f"{Path(fr.filename).relative_to(SRC).as_posix()}:{fr.lineno}"
    return "?"


def violations_of(name: str, bound: inspect.BoundArguments, device: torch.device | None) -> list[str]:
    """The NCCL rules one collective call breaks (module docstring)."""
    out = []
    tensors = [t for v in bound.arguments.values() for t in _tensors(v)]
    bound.apply_defaults()
    op = bound.arguments.get("op")
    if name in REJECTED:
        out.append(f"collective {name}")
    if op is not None and op not in NCCL_OPS:
        out.append(f"op {str(op).split('.')[-1]}")
    for t in tensors:
        if t.dtype not in NCCL_DTYPES:
            out.append(f"dtype {t.dtype}")
        if name in REDUCTIONS and t.dtype == torch.bool:
            out.append("reduction of bool")
        if device is not None and t.device != device:
            out.append(f"tensor on {t.device}, not {device}")
    return sorted(set(out))


class NcclRules:
    """Within ``with``: every ``torch.distributed`` collective checked against NCCL's rules; ``found`` holds
    ``(collective, rule, caller)``; ``strict``: a violating call raises instead of running."""

    def __init__(self, device: torch.device | None = None, strict: bool = False):
        self.device, self.strict, self.found, self._real = device, strict, [], {}
        self.calls: set[tuple[str, str]] = set()  # (collective, library file) of every call checked

    def _wrap(self, name, real):
        sig = inspect.signature(real)

        def call(*a, **k):
            bad = violations_of(name, sig.bind(*a, **k), self.device)
            self.calls.add((name, _caller().rsplit(":", 1)[0]))
            self.found += [(name, b, _caller()) for b in bad]
            if bad and self.strict:
                raise RuntimeError(f"NCCL rejects {name}: {', '.join(bad)} ({_caller()})")
            return real(*a, **k)
        return call

    def __enter__(self):
        for n in COLLECTIVES:
            self._real[n] = getattr(dist, n)
            setattr(dist, n, self._wrap(n, self._real[n]))
        return self

    def __exit__(self, *exc):
        for n, f in self._real.items():
            setattr(dist, n, f)


def _calls(rank, world):
    """Hand-chosen calls, each with the rules NCCL's process group applies to it."""
    cases = [
        (lambda: dist.all_reduce(torch.ones(3)), []),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=R.MAX), []),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint8), op=R.BOR), ["op BOR"]),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), R.BAND), ["op BAND"]),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)), ["dtype torch.int16"]),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)), ["reduction of bool"]),
        (lambda: dist.all_gather([torch.zeros(2, dtype=torch.bool) for _ in range(world)],
                                 torch.ones(2, dtype=torch.bool)), []),  # moved as bytes: no reduction
        (lambda: dist.gather(torch.ones(2), [torch.zeros(2) for _ in range(world)] if rank == 0 else None, 0),
         ["collective gather"]),
        (lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64)), ["dtype torch.complex64"]),
        (lambda: dist.all_gather([torch.zeros(2, dtype=torch.int16) for _ in range(world)],
                                 torch.ones(2, dtype=torch.int16)), ["dtype torch.int16"]),
        (lambda: dist.all_to_all_single(torch.zeros(world), torch.ones(world)), []),
        (lambda: dist.broadcast(torch.ones(2, dtype=torch.float64), 0), []),
    ]
    out = []
    for fn, want in cases:
        with NcclRules(strict=True) as rules:  # a violating call stops before gloo (which lacks some dtypes too)
            try:
                fn()
            except RuntimeError as e:
                assert "NCCL rejects" in str(e), e
        out.append(([b for _, b, _ in rules.found], want))
    with NcclRules(device=torch.device("cuda", rank)) as rules:  # a CUDA run handing NCCL a host tensor
        dist.all_reduce(torch.ones(2))
    out.append(([b for _, b, _ in rules.found], [f"tensor on cpu, not cuda:{rank}"]))
    return out


def test_rules_against_hand_listed_calls():
    for res in spawn_local(_calls, 2, timeout_s=300):
        for got, want in res:
            assert got == want


def _steps(rank, world, runs):
    """Every ``(name, config, run directory)`` of ``runs`` trained in turn on this rank, under the rules."""
    from embedscale.train.ranks import train_distributed

    found = {}
    for name, cfg_dict, run_dir in runs:
        with NcclRules() as rules:
            train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
        found[name] = (sorted({f"{c} {b} ({w})" for c, b, w in rules.found}),
                       sorted(f"{c} {w}" for c, w in rules.calls))
    return found


def _run_all(runs, expect_calls):
    """Train ``runs`` on 2 ranks; no call breaks a rule, and each run made the calls ``expect_calls[name]``
    lists (``collective library-file``: the parts under test did run under the rules)."""
    for res in spawn_local(_steps, 2, runs, timeout_s=900):
        assert set(res) == {name for name, _c, _r in runs}
        bad = {k: v[0] for k, v in res.items() if v[0]}
        assert not bad, f"collectives NCCL would reject: {bad}"
        for name, (_bad, calls) in res.items():
            # the design's all-to-alls count from its own file or from the transport that runs them (an exchange
            # started during the bottom MLP is issued by comm/collective.py)
            via_transport = "all_to_all_single comm/collective.py" in calls
            missing = {c for c in expect_calls[name] if c not in calls
                       and not (via_transport and c.startswith("all_to_all_single embedding/"))}
            assert not missing, (name, missing, calls)


SYNC_CALLS = {"local_aggregated": ["all_reduce embedding/grad_sync.py"], "dense": ["all_reduce embedding/grad_sync.py"],
              "allgather": ["all_gather embedding/grad_sync.py"], "alltoall": []}


def test_sharded_training_steps_of_every_design_and_sync_use_only_collectives_nccl_takes(tmp_path):
    from test_distributed_train import config, hand_plan, make_data

    make_data(tmp_path / "data")
    hand_plan("replicas", 2).save(tmp_path / "plan")  # replicas: the gradient sync runs
    runs, expect = [], {}
    for design, syncs in (("retrieve", ("local_aggregated", "alltoall", "dense", "allgather")),
                          ("send", ("local_aggregated", "dense", "allgather"))):
        for sync in syncs:
            for prefetch in ((0, 2) if design == "retrieve" else (0,)):  # 2: the fused exchanges of prefetching
                cfg = config(tmp_path, tmp_path / "data", design=design, plan=str(tmp_path / "plan"))
                cfg.dist.grad_sync, cfg.train.prefetch, cfg.train.max_steps = sync, prefetch, 3
                name = f"{design}-{sync}-prefetch{prefetch}"
                runs.append((name, to_dict(cfg), str(tmp_path / name)))
                expect[name] = [f"all_to_all_single embedding/{design}.py"] + SYNC_CALLS[sync]
    _run_all(runs, expect)


def test_tt_and_host_table_training_steps_use_only_collectives_nccl_takes(tmp_path):
    import test_distributed_host as host
    import test_tt_distributed as tt

    tt.make_data(tmp_path / "tt-data")
    tt.hand_plan("replicas", 2).save(tmp_path / "tt-plan")
    host.make_data(tmp_path / "host-data")
    runs = []
    for design in ("retrieve", "send"):
        cfg = tt.config(tmp_path, tmp_path / "tt-data", str(tmp_path / "tt-plan"), design, steps=3)
        runs.append((f"tt-{design}", to_dict(cfg), str(tmp_path / f"tt-{design}")))
    cfg = host.config(tmp_path, tmp_path / "host-data", host=True, depth=2, steps=3)
    runs.append(("host", to_dict(cfg), str(tmp_path / "host")))
    tt_sync = "all_reduce embedding/compression.py"  # the TT cores' gradient AllReduce (ReplicaGradSync)
    _run_all(runs, {"tt-retrieve": [tt_sync, "all_to_all_single embedding/retrieve.py"],
                    "tt-send": [tt_sync, "all_to_all_single embedding/send.py"],
                    "host": [tt_sync, "all_gather pipeline/embedding.py"]})  # the host pipeline's gather
