"""Every collective of a sharded training step is one NCCL takes, checked on CPU over gloo.

``NcclRules`` wraps ``torch.distributed``'s collectives in a rank process (every call site of the library goes
through ``dist.<collective>``: the transports' all-to-alls and the replica gradient sync, the profile's and the
monitor's reductions alike) and checks each call against the rules of PyTorch's NCCL process group
(``ProcessGroupNCCL``: ``getNcclReduceOp``, its ``ncclDataType`` map), written out below as plain tables:

- reduce ops: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM; BAND, BOR and BXOR are rejected; AVG of bool is rejected;
- dtypes: int8, uint8, int32, int64, float16, bfloat16, float32, float64, bool (sent as uint8) and the float8
  types; anything else (int16, uint16/32/64, complex) is rejected;
- a CUDA run's tensors are all on the accelerator (``device``): a host tensor handed to NCCL is rejected.

The call then runs on gloo as before, so a training step runs to its end and reports every violation it makes,
each with the collective and the library line that called it. ``KNOWN`` lists the violations the executor makes
today, each with its reason; the step test fails on any other, and on a known one that is gone (the list only
shrinks).
"""

from __future__ import annotations

import inspect
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from embedscale.specs import RunConfig, from_dict, to_dict
from embedscale.train.launch import spawn_local

R = dist.ReduceOp
NCCL_OPS = {R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.PREMUL_SUM}
NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
               torch.float64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz}
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "gather", "scatter",
               "send", "recv", "isend", "irecv")
SRC = str(Path(__file__).resolve().parents[1] / "src" / "embedscale")

# (collective, rule, library file): violations a 2-rank sharded step makes today, each with its reason
KNOWN = {
    ("all_reduce", "op BOR", "embedding/grad_sync.py"):
        "the local-aggregated replica gradient sync ORs a packed row bitmap (one bit per replica row); NCCL has "
        "no bitwise reduction: a MAX over one byte per row (8x the bytes) or an all_gather of the bitmaps and an "
        "OR on the device would do",
}


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
    if op is not None and op not in NCCL_OPS:
        out.append(f"op {str(op).split('.')[-1]}")
    for t in tensors:
        if t.dtype not in NCCL_DTYPES:
            out.append(f"dtype {t.dtype}")
        if op == R.AVG and t.dtype == torch.bool:
            out.append("op AVG on bool")
        if device is not None and t.device != device:
            out.append(f"tensor on {t.device}, not {device}")
    return sorted(set(out))


class NcclRules:
    """Within ``with``: every ``torch.distributed`` collective checked against NCCL's rules; ``found`` holds
    ``(collective, rule, caller)``; ``strict``: a violating call raises instead of running."""

    def __init__(self, device: torch.device | None = None, strict: bool = False):
        self.device, self.strict, self.found, self._real = device, strict, [], {}

    def _wrap(self, name, real):
        sig = inspect.signature(real)

        def call(*a, **k):
            bad = violations_of(name, sig.bind(*a, **k), self.device)
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
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)), []),  # bool SUM runs as MAX
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


def _step(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    with NcclRules() as rules:
        train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return [list(v) for v in rules.found]


@pytest.mark.parametrize("design,grad_sync", [("retrieve", "local_aggregated"), ("retrieve", "alltoall"),
                                              ("retrieve", "dense"), ("send", "allgather")])
def test_a_sharded_training_step_uses_only_collectives_nccl_takes(tmp_path, design, grad_sync):
    from test_distributed_train import config, hand_plan, make_data

    make_data(tmp_path / "data")
    hand_plan("replicas", 2).save(tmp_path / "plan")  # replicas: the gradient sync runs
    cfg = config(tmp_path, tmp_path / "data", design=design, plan=str(tmp_path / "plan"))
    cfg.dist.grad_sync = grad_sync
    cfg.train.max_steps = 2
    found = set()
    for res in spawn_local(_step, 2, to_dict(cfg), str(tmp_path / "run"), timeout_s=600):
        found |= {(name, rule, where.rsplit(":", 1)[0]) for name, rule, where in res}
    known_here = {k for k in KNOWN if grad_sync == "local_aggregated" or "grad_sync" not in k[2]}
    assert found == known_here, f"new NCCL violations: {found - known_here}; fixed, drop from KNOWN: " \
                                f"{known_here - found}"
