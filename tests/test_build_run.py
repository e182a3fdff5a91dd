"""The one assembly point (``assemble.build_run``): a run's parts against a model, optimizer and loaders built by
hand here from the public pieces (the embedding builder, the model, a ``ShardLoader`` over the split's rows)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_train import config, make_data  # noqa: E402

from embedscale import assemble  # noqa: E402
from embedscale.data.loader import ShardLoader  # noqa: E402
from embedscale.embedding.optim import set_weight_decay  # noqa: E402
from embedscale.models import build_model  # noqa: E402
from embedscale.models.builder import EmbeddingEnv, build_embedding  # noqa: E402
from embedscale.models.dlrm import set_dropout  # noqa: E402
from embedscale.plan.forms import config_forms  # noqa: E402
from embedscale.specs import TableSpec  # noqa: E402

CPU = torch.device("cpu")


def hand_built(cfg, tables, num_dense):
    """The model and dense optimizer a world of one trains, made here step by step: seeded by ``train.seed``, the
    config's forms, rows that update themselves (fused optimizer), Adagrad over every other parameter."""
    t = cfg.train
    torch.manual_seed(t.seed)
    emb = build_embedding(tables, None, EmbeddingEnv(device=CPU, optimizer=t.sparse_optimizer, lr=t.lr_sparse,
                                                     tt_lr=t.lr_sparse, seed=t.seed),
                          forms=config_forms(cfg.model, tables))
    model = build_model(cfg.model, tables, num_dense, embedding=emb, device=CPU)
    set_dropout(model, t.dropout)
    set_weight_decay(model, t.sparse_weight_decay)  # the run's rows' L2 (resolved from the data: several passes)
    emb_ids = {id(p) for p in emb.parameters()}
    opt = torch.optim.Adagrad([p for p in model.parameters() if id(p) not in emb_ids], lr=t.lr_dense)
    return model, opt


def train_steps(model, opt, batches):
    torch.manual_seed(1)  # the same dropout masks for both
    losses = []
    for b in batches:
        logits = model(b.dense, b.sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_parts_of_a_world_of_one_train_as_the_hand_built_model(tmp_path):
    make_data(tmp_path / "data")
    cfg = config(tmp_path, tmp_path / "data")
    inputs = assemble.run_inputs(cfg, progress=False)
    parts = assemble.build_run(cfg, inputs, CPU)
    assert cfg.train.sparse_weight_decay == 0.0  # 6 steps of 50 of 320 training rows: within the first pass
    assert [t.name for t in parts.tables] == [f"t_C{i}" for i in range(1, 5)]  # one table per feature
    assert all(type(t) is TableSpec for t in parts.tables) and {f.kind for f in parts.forms.values()} == {"sharded"}
    model, opt = hand_built(cfg, parts.tables, inputs.data.manifest.num_dense)
    got, want = parts.model.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # same seeded weights
    split = inputs.data.train  # the training loader: the train split's rows, in the loader's order
    loader = ShardLoader(split.directory, cfg.train.batch_size, start=split.start, stop=split.stop, prefetch=0)
    assert len(parts.train_loader) == len(loader) == 7
    parts.train_loader.set_epoch(0)
    loader.set_epoch(0)
    assert train_steps(parts.model, parts.opt, parts.train_loader) == train_steps(model, opt, loader)  # bitwise
    got, want = parts.model.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    ev = inputs.data.eval  # the eval split: the last 20% of the rows
    assert (ev.start, ev.stop) == (320, 400)
    assert sum(b.batch_size for b in parts.eval_loader) == 80


def test_an_inference_run_has_no_training_loader(tmp_path):
    make_data(tmp_path / "data")
    cfg = config(tmp_path, tmp_path / "data")
    parts = assemble.build_run(cfg, assemble.run_inputs(cfg, progress=False), CPU, inference=True)
    assert parts.train_loader is None
    assert sum(b.batch_size for b in parts.eval_loader) == 80
