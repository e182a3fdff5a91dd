"""The bytes one training step puts on the wire, against values counted by hand, for a small hand plan.

Published figures: the transport's counters (forward ids and rows, backward gradients, count metadata),
the replica gradient sync's bytes, the TT replicas' core gradient sync (``tt_grad_sync_bytes``), and what a
run reports per step (``train.distributed``: ``embedding_bytes_on_wire_per_step`` and
``grad_sync_bytes_per_step`` in the summary). The reference is
brute force from this file's own plan: which rank owns a row, and so which distinct rows (retrieve) or
values and partial bags (send) a rank's batch needs from each peer, times the bytes of an int64 id, of a
float32 scale and of a ``dim``-float32 row, by ``comm.transport``'s counting convention (bytes a rank
sends; all_to_all: its off-rank splits; ring all_reduce ``2 (W - 1) / W x n``, rounded down).

Plan (``W`` ranks, three tables of 12 rows, dim 4): table 0 on rank 0 with its rows 0 and 1 replicated on
every rank, table 1 on rank ``1 % W``, table 2 on rank ``2 % W``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embedscale.comm.collective import CollectiveTransport
from embedscale.data.batch import JaggedFeatures
from embedscale.data.shards import ShardWriter, SparseFeatureInfo
from embedscale.embedding.address_map import address_map_from_plan
from embedscale.embedding.compression import replica_grad_sync
from embedscale.embedding.sharded import ShardedEmbedding
from embedscale.plan.plan import Plan
from embedscale.specs import RunConfig, TableSpec, from_dict, to_dict
from embedscale.train.launch import spawn_local

ROWS, DIM = 12, 4
T = 3
REPLICATED = 2  # rows 0 and 1 of table 0: every rank holds them
ID, SCALE, ROW = 8, 4, DIM * 4  # bytes: an int64 id, a float32 per-value scale, a float32 row (or gradient)


def tables():
    return [TableSpec(f"t_C{t + 1}", ROWS, DIM, features=[f"C{t + 1}"]) for t in range(T)]


def hand_plan(world: int) -> Plan:
    everyone = np.ones(world, bool)
    only = [np.eye(world, dtype=bool)[t % world] for t in range(T)]
    return Plan(tables(), world, [None] * T, [0, 0, 1, 2], [0, REPLICATED, 0, 0], [REPLICATED, ROWS, ROWS, ROWS],
                owner=[0, 0, 1 % world, 2 % world], holders=np.array([everyone, only[0], only[1], only[2]]),
                meta={"strategy": "hand"})


def owner(t: int, row: int, world: int) -> int | None:
    """Who a rank reads table ``t``'s ``row`` from, ``None`` when every rank holds it (this file's plan)."""
    return None if (t == 0 and row < REPLICATED) else t % world


def batch(rank: int) -> list[list[list[int]]]:
    """Rank ``rank``'s mini-batch: per table (feature), per sample, the ids (two samples, repeats)."""
    return [[[0, 5], [1, 5 + rank]],
            [[3, 3], [4 + rank]],
            [[7], [8, 9, rank]]]


def jagged(bags) -> JaggedFeatures:
    values = [i for feat in bags for bag in feat for i in bag]
    lengths = [len(bag) for feat in bags for bag in feat]
    return JaggedFeatures([f"C{t + 1}" for t in range(T)], torch.tensor(values, dtype=torch.int64),
                          torch.tensor(lengths, dtype=torch.int64))


# -- the hand count -------------------------------------------------------------------------------
def retrieve_rows(bags, me: int, world: int) -> list[int]:
    """Distinct rows rank ``me`` fetches from each rank (retrieve: remote rows deduplicated per source)."""
    need = [set() for _ in range(world)]
    for t, feat in enumerate(bags):
        for bag in feat:
            for i in bag:
                src = owner(t, i, world)
                if src is not None and src != me:
                    need[src].add((t, i))
    return [len(s) for s in need]


def send_values_and_bags(bags, me: int, world: int) -> tuple[list[int], list[int]]:
    """Per rank: the values rank ``me`` sends it (send: not deduplicated) and the partial bags they form
    (one per (bag, owner))."""
    vals, pbags = [0] * world, [set() for _ in range(world)]
    for t, feat in enumerate(bags):
        for b, bag in enumerate(feat):
            for i in bag:
                src = owner(t, i, world)
                if src is not None and src != me:
                    vals[src] += 1
                    pbags[src].add((t, b))
    return vals, [len(s) for s in pbags]


def touched_replicas(bags) -> set:
    return {i for i in (v for bag in bags[0] for v in bag) if i < REPLICATED}


def expected_step(batches, world: int, design: str, sync: str) -> list[dict]:
    """Per rank, the bytes it sends in one training step, by kind (forward ``ids``, ``rows`` / ``pooled``,
    backward ``grads``), the count metadata and the replica sync's bytes."""
    ring = 2 * (world - 1)  # ring all_reduce: 2 (W - 1) / W x n, the division last
    union = set().union(*(touched_replicas(b) for b in batches))
    out = []
    for me in range(world):
        peers = [p for p in range(world) if p != me]
        if design == "retrieve":
            k = retrieve_rows(batches[me], me, world)
            served = [retrieve_rows(batches[q], q, world)[me] for q in range(world)]  # rows peers ask of me
            extra = len(touched_replicas(batches[me])) if sync == "alltoall" else 0  # they ride along
            e = {"ids": sum((k[p] + extra) * ID for p in peers),
                 "rows": sum(served[q] * ROW for q in range(world) if q != me),
                 "grads": sum((k[p] + extra) * ROW for p in peers),
                 "meta": (world - 1) * ID * (2 if sync == "alltoall" else 1)}  # one count swap (2 numbers fused)
        else:
            vals, pb = send_values_and_bags(batches[me], me, world)
            asked = [send_values_and_bags(batches[q], q, world)[1][me] for q in range(world)]
            e = {"ids": sum(vals[p] * (2 * ID + SCALE) for p in peers),  # (offset, partial bag) + scale
                 "pooled": sum(asked[q] * ROW for q in range(world) if q != me),
                 "grads": sum(pb[p] * ROW for p in peers),
                 "meta": 2 * (world - 1) * ID}  # ids and scales each swap counts once
        bitmap = (REPLICATED * 2 + 7) // 8  # 2 replica rows, 2 bits each (a count of up to 3 ranks): 1 byte
        e["sync"] = 0 if sync == "alltoall" else ring * bitmap // world + ring * (len(union) * ROW) // world
        out.append(e)
    return out


# -- one step of the sharded embedding ------------------------------------------------------------
CASES = (("retrieve", "local_aggregated"), ("send", "local_aggregated"), ("retrieve", "alltoall"))


def _step_worker(rank, world):
    plan = hand_plan(world)
    amap = address_map_from_plan(plan, tables())
    res = {}
    for design, sync in CASES:
        tr = CollectiveTransport()
        emb = ShardedEmbedding(tables(), amap, tr, rank, design=design, optimizer="sgd", lr=0.1, grad_sync=sync)
        tr.counter.reset()
        out = emb(jagged(batch(rank)))
        fwd = dict(tr.counter.by_kind)
        out.sum().backward()
        got = {k: v for k, v in tr.counter.by_kind.items()}
        assert set(fwd) | {"grads"} >= set(got) and "grads" not in fwd  # gradients only in backward
        got["meta"] = int(tr.counter.meta)
        got["sync"] = int(emb.stats.get("grad_sync_bytes", 0))
        got["sent_total"] = int(tr.counter.sent.sum())
        res[(design, sync)] = got
    # TT replicas' core gradients (EL-Rec VI-B): one ring all_reduce of the cores flattened together
    st: dict = {}
    cores = [torch.full((3, 4), float(rank + 1)), torch.full((5,), 2.0 * (rank + 1))]
    replica_grad_sync(stats=st)(cores)
    res["tt"] = (st["tt_grad_sync_bytes"], cores[0][0, 0].item(), cores[1][0].item())
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_one_step_bytes_equal_the_hand_count(world):
    results = spawn_local(_step_worker, world, timeout_s=300)
    batches = [batch(r) for r in range(world)]
    for case in CASES:
        want = expected_step(batches, world, *case)
        for r in range(world):
            got = dict(results[r][case])
            total = got.pop("sent_total")
            assert got == want[r], (world, case, r, got, want[r])
            assert total == sum(v for k, v in want[r].items() if k not in ("meta", "sync"))
    ranks = world * (world + 1) // 2  # 1 + 2 + ... + W
    for r in range(world):  # 12 + 5 float32 values, ring all_reduce: 2 (W - 1) / W x 68 bytes
        assert results[r]["tt"] == (2 * (world - 1) * ((12 + 5) * 4) // world, float(ranks), 2.0 * ranks)


def test_hand_count_at_two_ranks_in_numbers():
    """The brute force above for 2 ranks, retrieve, written out: rank 0 fetches table 1's rows {3, 4} from
    rank 1; rank 1 fetches table 0's rows {5, 6} and table 2's rows {7, 8, 9, 1} from rank 0."""
    want = expected_step([batch(0), batch(1)], 2, "retrieve", "local_aggregated")
    assert want[0] == {"ids": 2 * 8, "rows": 6 * 16, "grads": 2 * 16, "meta": 8, "sync": 1 + 2 * 16}
    assert want[1] == {"ids": 6 * 8, "rows": 2 * 16, "grads": 6 * 16, "meta": 8, "sync": 1 + 2 * 16}


# -- what a run reports ---------------------------------------------------------------------------
STEPS, GLOBAL_B = 2, 4
# one id per sample and feature: 2 steps x 4 samples (rank r gets samples 2r, 2r + 1 of every step)
IDS = {"C1": [0, 5, 1, 6, 0, 7, 7, 1], "C2": [3, 3, 4, 2, 5, 6, 5, 5], "C3": [7, 8, 9, 1, 2, 2, 3, 4]}


def run_batches(step: int, world: int) -> list:
    per = GLOBAL_B // world
    lo = step * GLOBAL_B
    return [[[[IDS[f"C{t + 1}"][lo + r * per + b]] for b in range(per)] for t in range(T)] for r in range(world)]


def _run_rank(rank, world, cfg_dict, run_dir):
    from embedscale.train.ranks import train_distributed

    train_distributed(from_dict(RunConfig, cfg_dict), run_dir, progress=False)
    return True


def test_run_reports_the_hand_counted_bytes_per_step(tmp_path):
    world = 2
    rng = np.random.default_rng(0)
    n = STEPS * GLOBAL_B
    data = tmp_path / "data"
    with ShardWriter(data, ["I1"], [SparseFeatureInfo(f"C{t + 1}", ROWS) for t in range(T)], shard_rows=n) as w:
        w.write((rng.random(n) < 0.5).astype(np.int8), rng.normal(size=(n, 1)).astype(np.float32),
                {k: np.array(v, dtype=np.int64) for k, v in IDS.items()})
    hand_plan(world).save(tmp_path / "plan")
    cfg = from_dict(RunConfig, {
        "name": "bytes", "out_dir": str(tmp_path / "runs"),
        "data": {"source": "shards", "path": str(data), "eval_fraction": 0.0},
        "model": {"embedding_dim": DIM, "bottom_mlp": [4], "top_mlp": [4]},
        "train": {"batch_size": GLOBAL_B, "max_steps": STEPS, "log_every": 1, "prefetch": 0},
        "dist": {"design": "retrieve", "plan": str(tmp_path / "plan"), "grad_sync": "local_aggregated",
                 "timeout_s": 300},
    })
    run_dir = tmp_path / "run"
    spawn_local(_run_rank, world, to_dict(cfg), str(run_dir), timeout_s=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    wire, sync = [], []
    for s in range(STEPS):
        want = expected_step(run_batches(s, world), world, "retrieve", "local_aggregated")
        wire.append(sum(w["ids"] + w["rows"] + w["grads"] for w in want))  # summed over ranks
        sync.append(sum(w["sync"] for w in want))
    # step 0: rank 0 fetches C2's rows {3} from rank 1, rank 1 C1's {6}, C3's {9, 1} from rank 0; every
    # replica row (C1's 0, 1) touched: 1 bitmap byte + 2 rows x 16 bytes on each rank
    assert wire[0] == (1 + 3) * (8 + 16 + 16) and sync[0] == 2 * (1 + 2 * 16)
    assert summary["embedding_bytes_on_wire_per_step"] == np.mean(wire)
    assert summary["grad_sync_bytes_per_step"] == np.mean(sync)
