"""TorchRec's side of ``bench_vs_torchrec``: a DLRM over an EmbeddingBagCollection of our tables, sharded by
TorchRec's own planner and wrapped in ``DistributedModelParallel`` (gloo, CPU: FBGEMM's CPU TBE kernels),
plus the bookkeeping the benchmark needs on both sides: weight copying (so both models start equal),
byte counters on the collectives, and DDP comm hooks that count what DDP's C++ reducer sends.

Nothing here is library code: it is the baseline harness, kept apart so the benchmark reads as a benchmark.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# -- byte counting -----------------------------------------------------------------------------------
#
# Every embedding exchange on both sides is a ``dist.all_to_all_single`` called from Python (our
# CollectiveTransport; TorchRec's KJT and pooled-embedding all-to-alls), so one wrapper counts both the
# same way: the bytes a rank sends to *other* ranks (its own split stays local). DDP's AllReduces run in
# C++ and are counted by the comm hooks below (ring model: 2 (W-1)/W of the bucket per rank, as OPER eq. 5
# and our grad_sync count).

BYTES = {"a2a": 0, "a2a_calls": 0}
_PATCHED = False


def _a2a_sent(inp: torch.Tensor, input_split_sizes, group) -> int:
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    rows = inp.shape[0] if inp.dim() else inp.numel()
    per_row = (inp.numel() // max(rows, 1)) * inp.element_size() if rows else 0
    if input_split_sizes is None or len(input_split_sizes) == 0:
        splits = [rows // world] * world
    else:
        splits = [int(s) for s in input_split_sizes]
    return int(sum(s for p, s in enumerate(splits) if p != me) * per_row)


def patch_collectives() -> None:
    """Wrap ``torch.distributed.all_to_all_single`` with a counter (idempotent, this process only)."""
    global _PATCHED
    if _PATCHED:
        return
    orig = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        BYTES["a2a"] += _a2a_sent(input, input_split_sizes, group)
        BYTES["a2a_calls"] += 1
        return orig(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                    group=group, async_op=async_op)

    dist.all_to_all_single = counted
    _PATCHED = True


def ring_bytes(numel_bytes: int, world: int) -> int:
    return int(2 * (world - 1) * numel_bytes // max(world, 1))


class HookCounter:
    """DDP comm hook state: counts ring-AllReduce bytes; ``mean`` divides by the world (DDP's default)."""

    def __init__(self, mean: bool):
        self.mean = mean
        self.bytes = 0
        self.world = dist.get_world_size()


def counting_allreduce_hook(state: HookCounter, bucket):
    buf = bucket.buffer()
    state.bytes += ring_bytes(buf.numel() * buf.element_size(), state.world)
    if state.mean:
        buf.div_(state.world)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# -- the TorchRec model --------------------------------------------------------------------------------

def build_torchrec_dlrm(tables, bottom_mlp, top_mlp, *, world: int, batch_per_rank: int, optimizer: str,
                        lr: float, eps: float, num_dense: int = 13):
    """TorchRec DLRM on a meta-device EBC (DMP materialises only this rank's shards), with the fused
    in-backward optimizer ``optimizer`` (``sgd`` -> EXACT_SGD, ``rowwise_adagrad`` -> EXACT_ROWWISE_ADAGRAD)
    and the sharding plan of TorchRec's ``EmbeddingShardingPlanner`` on ``world`` CPU ranks of one host.

    Returns ``(unsharded model, plan)``; wrap it with ``wrap_dmp``. Dense layers are on CPU, as built
    by TorchRec (copy our weights into them before wrapping).
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows,
                                  feature_names=list(t.features),
                                  pooling=PoolingType.SUM if t.pooling == "sum" else PoolingType.MEAN)
               for t in tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    dim = tables[0].dim
    model = DLRM(ebc, num_dense, list(bottom_mlp) + [dim], list(top_mlp) + [1])
    same_interaction(model.inter_arch)
    if optimizer == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": lr})
    elif optimizer == "rowwise_adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": lr, "eps": eps})
    else:
        raise ValueError(f"optimizer {optimizer!r}")
    topo = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch_per_rank)
        plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
    return model, plan


def same_interaction(inter_arch) -> None:
    """Give TorchRec's dot interaction our kernel for the same op: it runs ``embedscale.models.dlrm.InteractionArch``
    (the pairs by one ``index_select`` of the flattened Gram matrix; TorchRec gathers ``gram[:, i, j]``, half as
    fast forward + backward on this CPU, ``bench_interaction.py``), so the comparison is about the embeddings."""
    from embedscale.models.dlrm import InteractionArch

    inter_arch.ours = InteractionArch(inter_arch.F, device=inter_arch.triu_indices.device)  # moves with the model
    inter_arch.forward = inter_arch.ours.forward


def wrap_dmp(model, plan):
    """``DistributedModelParallel`` over the default group; returns ``(dmp, dense hook, dp-table hook)``:
    counting comm hooks on DMP's dense DDP and on every data-parallel table group's DDP."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                           device=torch.device("cpu"), plan=plan,
                                           sharders=[EmbeddingBagCollectionSharder()])
    finally:
        logging.getLogger().setLevel(level)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dense_hook, dp_hook = HookCounter(mean=True), HookCounter(mean=True)
    outer = dmp._dmp_wrapped_module
    if isinstance(outer, DDP):
        outer.register_comm_hook(dense_hook, counting_allreduce_hook)
    # the data-parallel tables' lookups: TorchRec wraps each in its own DDP, kept in a plain list
    # (``ShardedEmbeddingBagCollection._lookups``), so ``modules()`` does not reach them
    dp_ddps = [lk for m in outer.modules() for lk in getattr(m, "_lookups", []) if isinstance(lk, DDP)]
    for lk in dp_ddps:
        lk.register_comm_hook(dp_hook, counting_allreduce_hook)
    dp_hook.modules = len(dp_ddps)
    return dmp, dense_hook, dp_hook


def split_dense_optimizers(dmp, optimizer: str, lr: float, eps: float, dense_lr: float):
    """TorchRec's non-fused parameters: the dense arches (plain SGD, as ours) and the tables TorchRec's
    planner made data-parallel. Those run on its *dense* embedding kernel, whose parameters get no
    in-backward (fused) optimizer: TorchRec's DLRM example trains them with its dense optimizer. Here they
    get the same kind of optimizer as the fused tables (TorchRec's own ``RowWiseAdagrad``, or SGD), so both
    models train the same thing. Returns ``(dense optimizer, data-parallel-table optimizer or None)``."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    rest = list(in_backward_optimizer_filter(dmp.named_parameters()))
    tables = [p for n, p in rest if "embedding_bags" in n]
    dense = [p for n, p in rest if "embedding_bags" not in n]
    dense_opt = torch.optim.SGD(dense, lr=dense_lr)
    if not tables:
        return dense_opt, None
    if optimizer == "sgd":
        return dense_opt, torch.optim.SGD(tables, lr=lr)
    return dense_opt, RowWiseAdagrad(tables, lr=lr, eps=eps)


def inner_dlrm(dmp):
    """The (sharded) torchrec DLRM inside DMP's DDP."""
    m = dmp._dmp_wrapped_module
    return m.module if hasattr(m, "module") else m


def sharding_types(plan) -> dict[str, str]:
    per = next(iter(plan.plan.values()))
    return {k: v.sharding_type for k, v in per.items()}


# -- same initial weights ------------------------------------------------------------------------------

def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def copy_dense(ours: nn.Module, theirs: nn.Module) -> None:
    """Our DLRM's bottom and top MLP weights into TorchRec's DLRM (same layer order and shapes)."""
    for a, b in ((ours.dense_arch, theirs.dense_arch), (ours.over_arch, theirs.over_arch)):
        la, lb = _linears(a), _linears(b)
        assert [tuple(x.weight.shape) for x in la] == [tuple(x.weight.shape) for x in lb], (la, lb)
        with torch.no_grad():
            for x, y in zip(la, lb):
                y.weight.copy_(x.weight)
                y.bias.copy_(x.bias)


def copy_embeddings(dmp, tables, seed: int = 0) -> int:
    """Write our placement-independent initial rows (``embedding.init.uniform_rows``) into every shard
    TorchRec holds on this rank (table-wise/row-wise/column-wise shards and data-parallel copies)."""
    from embedscale.embedding.init import uniform_rows

    sd = dmp.state_dict()
    n = 0
    for t, spec in enumerate(tables):
        key = next(k for k in sd if k.endswith(f"embedding_bags.{spec.name}.weight"))
        w = sd[key]
        if hasattr(w, "local_shards"):
            parts = [(s.tensor, s.metadata.shard_offsets) for s in w.local_shards()]
        else:
            parts = [(w, [0, 0])]
        for tensor, (r0, c0) in parts:
            rows = np.arange(r0, r0 + tensor.shape[0])
            full = uniform_rows(seed, t, rows, spec.dim, spec.num_rows)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(full[:, c0:c0 + tensor.shape[1]]))
            n += tensor.shape[0]
    return n


# -- TorchRec's train pipeline (its best form of a training step) -----------------------------------------------

class _Optimizers:
    """Several optimizers stepped as one (what ``TrainPipelineSparseDist`` takes)."""

    def __init__(self, *opts):
        self.opts = [o for o in opts if o is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def train_pipeline(dmp, batches, dense_opt, dp_opt):
    """TorchRec's ``TrainPipelineSparseDist`` over ``dmp`` (CPU: no streams): the next batch's input
    distribution (its KJT all-to-alls) started during the current step, as TorchRec trains. ``batches`` are the
    steps' ``(dense, kjt, labels)`` in order (cycled). The DLRM inside takes a torchrec ``Batch`` while the
    pipeline runs (its loss: the mean BCE, TorchRec's convention). Returns ``(step, detach)``: ``step()`` trains
    the next batch; ``detach()`` gives the model back its own forward (for the inference phases)."""
    import torch.nn.functional as F
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM

    class DLRMOnBatch(DLRM):
        def forward(self, batch):  # noqa: D102 - DLRMTrain's contract: (loss, output)
            logits = DLRM.forward(self, batch.dense_features, batch.sparse_features).squeeze(-1)
            return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()

    inner = inner_dlrm(dmp)
    inner.__class__ = DLRMOnBatch

    def feed():
        k = 0
        while True:
            dense, kjt, labels = batches[k % len(batches)]
            yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)
            k += 1

    it = feed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = TrainPipelineSparseDist(dmp, _Optimizers(dense_opt, dp_opt), torch.device("cpu"))

    def detach():
        pipe.detach()
        inner.__class__ = DLRM

    return (lambda: pipe.progress(it)), detach
