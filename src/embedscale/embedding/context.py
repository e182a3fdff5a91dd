"""The per-batch context of the sharded executor: what passes between a lookup's stages.

A sharded lookup runs in stages, as a TorchRec ``ShardedModule`` does (``create_context`` / ``input_dist`` /
``compute`` / ``output_dist``, then the backward's ``grad_dist`` / ``update``; ``embedding.sharded``). The module
holds only its storage; everything one batch's stages hand each other lives in that batch's context, and
``state`` says how far the batch went. A stage reads the fields of the stages before it and writes its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

import torch

from embedscale.comm.transport import PendingExchange
from embedscale.data.batch import JaggedFeatures


class Stage(enum.Enum):
    """How far a batch went through the stages."""

    NEW = enum.auto()  # created: nothing decoded yet
    DECODED = enum.auto()  # input_dist's local half: ids checked and decoded to (rank, offset), here only
    COUNTED = enum.auto()  # every owner knows how many rows it will be asked for (rode a previous exchange)
    ANNOUNCED = enum.auto()  # input_dist done: every owner holds this rank's requests
    FETCHING = enum.auto()  # compute started: the rows (or partial sums) on their way, not waited for yet
    POOLED = enum.auto()  # compute done: the bags pooled (output_dist lays them out per sample)
    GRADS_SENDING = enum.auto()  # grad_dist's exchange in flight beside the rest of the backward, not waited for
    GRADS_SENT = enum.auto()  # grad_dist done: every gradient is at the rank that applies it
    UPDATED = enum.auto()  # update done: the optimizer applied them


@dataclass(eq=False)
class LookupContext:
    """What every design's stages share: the batch, whether it trains, and how far it went."""

    features: JaggedFeatures
    training: bool
    state: Stage = Stage.NEW
    B: int = 0  # samples of the local mini-batch

    def take_over(self, ahead: LookupContext) -> None:
        """Continue from ``ahead``'s progress (the same batch, prepared ahead of its step), keeping this
        context's ``training``."""
        for f in fields(ahead):
            if f.name != "training":
                setattr(self, f.name, getattr(ahead, f.name))


@dataclass(eq=False)
class RetrieveContext(LookupContext):
    """The retrieve design (OPER 5.1-5.2): a rank fetches the remote rows its batch reads and pools locally.

    Decoded (``input_dist``'s local half, possibly ahead on the prefetch thread): every value's bag (feature
    major), scale, the bags' offsets, its packed key and, for remote values, their positions ``ridx`` and
    index ``rinv`` among the unique remote rows; ``per_rank`` rows requested of each rank, ``blocks`` the
    offsets requested (one block per owner), ``r_slot`` the replica slot of each fetched row (-1: none),
    ``t_slots`` the replica slots the batch reads (``fused``: they ride the request and gradient exchanges).
    Announced: ``recv_counts`` per peer ``(rows, replica slots)`` it will ask of this rank, then
    ``requests`` (the offsets each peer asked) and ``peer_slots``.
    Fetching: ``fetching``, the row exchange in flight (``with_header``: the next batch's counts ride it).
    Pooled: ``out`` (``[B * F, D]`` sample-major), each value's pooling-table row ``pos``, its sample-major
    bag ``bag_s`` (``None`` when the C++ kernel pooled), ``n`` storage rows, ``nxt`` the next batch's context
    whose counts rode this step's row exchange.
    Gradients sending: ``grads_in``, the gradient exchange in flight (``with_ids``: the next batch's requests
    ride it), started beside the rest of the backward when the model started the lookup ahead (``overlap``).
    Gradients sent: this rank's row sums ``rows_l`` / ``g_l``, the replica gradients ``rep_slots`` / ``rep_g``,
    what each peer sent back ``recv`` (and ``peer_g``, their replica sums).
    """

    bag: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    one_hot: bool = False
    key: torch.Tensor | None = None
    ridx: torch.Tensor | None = None
    rinv: torch.Tensor | None = None
    per_rank: list[int] = field(default_factory=list)
    r_slot: torch.Tensor | None = None
    t_slots: torch.Tensor | None = None
    blocks: list[torch.Tensor] = field(default_factory=list)
    fused: bool = False
    recv_counts: list[tuple[int, int]] | None = None
    requests: list[torch.Tensor] | None = None
    peer_slots: list[torch.Tensor] | None = None
    fetching: PendingExchange | None = None
    with_header: bool = False
    out: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    bag_s: torch.Tensor | None = None
    n: int = 0
    nxt: RetrieveContext | None = None
    rows_l: torch.Tensor | None = None
    g_l: torch.Tensor | None = None
    rep_slots: torch.Tensor | None = None
    rep_g: torch.Tensor | None = None
    recv: list[torch.Tensor] | None = None
    peer_g: list[torch.Tensor] | None = None
    overlap: bool = False
    grads_in: PendingExchange | None = None
    with_ids: bool = False
    plan: object | None = None  # the host-made lookup plan on the device (``retrieve.DevicePlan``), or None

    @property
    def kernel_pooled(self) -> bool:
        """Whether the C++ kernel pooled the batch (its backward sums the rows in one pass)."""
        return self.bag_s is None

    def header(self, me: int, W: int) -> torch.Tensor:
        """What this rank tells each peer about this batch ahead of its step: ``[rows it will request + 1,
        replica slots]`` (``[0, 0]`` means no batch prefetched)."""
        t = self.t_slots.numel() if self.fused else 0
        return torch.tensor([[c + 1, t] if p != me else [0, 0] for p, c in enumerate(self.per_rank)],
                            dtype=torch.int64)


@dataclass(eq=False)
class SendContext(LookupContext):
    """The send design: ids to their owners, owners pool partial bags, partial sums back.

    Decoded: every value's global id, bag and scale, ``nbags`` bags, the partial bags ``p_bag`` / ``p_counts`` and
    the messages to every owner ``out_ids`` / ``out_scale`` (``v_counts`` values each), the distinct owned and
    replica rows they read there ``u_counts``. Announced: the partial bags (one per
    (owner, bag), rank-major) ``p_bag`` / ``p_counts``, how many values and partial bags each peer sent and how
    many distinct owned and replica rows they read here (``recv_counts``; ``COUNTED`` when they rode the step
    before's pooled exchange, whose batch names this one ``nxt``), the ``(offset, partial bag)`` pairs and scales each peer sent (``recv_ids`` /
    ``recv_scale``; this rank's own ``my_ids`` / ``my_scale``). Pooled: ``pooled``,
    the partial sums this rank computed for every requester. Gradients sent: ``grads``, the partial bags'
    gradients each requester sent back.
    """

    gids: torch.Tensor | None = None
    bag: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    nbags: int = 0
    p_bag: torch.Tensor | None = None
    p_counts: list[int] = field(default_factory=list)
    v_counts: list[int] = field(default_factory=list)  # values sent to each owner
    u_counts: list[tuple[int, int]] = field(default_factory=list)  # distinct (owned, replica) rows read per owner
    recv_counts: list[tuple[int, int, int, int]] | None = None  # per peer: values, partial bags, distinct rows
    out_ids: list[torch.Tensor] | None = None
    out_scale: list[torch.Tensor] | None = None
    recv_ids: list[torch.Tensor] | None = None
    recv_scale: list[torch.Tensor] | None = None
    my_ids: torch.Tensor | None = None
    my_scale: torch.Tensor | None = None
    pooled: list[torch.Tensor] | None = None
    nxt: SendContext | None = None  # the next batch, whose counts rode this batch's pooled exchange
    grads: list[torch.Tensor] | None = None


@dataclass(eq=False)
class PgasRetrieveContext(LookupContext):
    """The retrieve design on the PGAS heap (``embedding.pgas_lookup``): rows read by one-sided gets.

    Decoded: every value's global id, bag, scale (``nbags`` bags of ``F`` features), its owner's offset
    ``off``, replica ``slot`` and whether it is ``local``; the unique remote rows ``runiq`` (each value's index
    ``rinv``; their owners ``u_src`` and offsets ``u_off``), how many come from each rank (``counts``, starting at
    ``starts``), the ranks on other hosts ``remote_src``. Announced: the requests of peers on other hosts
    (``requests``). Pooled: ``out`` (``[B, F * D]``), the rows other hosts sent ``fetched_remote``. Gradients
    sent: ``recv``, the ``(gradient | offset)`` rows peers pushed, and this rank's sums of local rows ``luniq`` /
    ``g_local`` (replicas ``rep_local``) and of remote ones ``g_remote`` (replicas ``rep_remote``).
    """

    gids: torch.Tensor | None = None
    bag: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    nbags: int = 0
    F: int = 0
    off: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    local: torch.Tensor | None = None
    runiq: torch.Tensor | None = None
    rinv: torch.Tensor | None = None
    u_src: torch.Tensor | None = None
    u_off: torch.Tensor | None = None
    counts: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    remote_src: list[int] = field(default_factory=list)
    requests: list[torch.Tensor] | None = None
    fetched_remote: list[torch.Tensor] | None = None
    out: torch.Tensor | None = None
    recv: list[torch.Tensor] | None = None
    luniq: torch.Tensor | None = None
    g_local: torch.Tensor | None = None
    g_remote: torch.Tensor | None = None
    rep_local: torch.Tensor | None = None
    rep_remote: torch.Tensor | None = None
    luniq_slot: torch.Tensor | None = None
    runiq_slot: torch.Tensor | None = None


class IdsLayout(enum.Enum):
    """How the PGAS send design's ids message to an owner is laid out (``embedding.pgas_lookup``)."""

    GENERAL = 0  # one partial bag per (owner, bag), any plan
    FEATURE_BLOCKS = 1  # every feature's table on one rank of this host: one block of values per feature


@dataclass(eq=False)
class PgasSendContext(LookupContext):
    """The send design on the PGAS heap: pooled vectors written at their final place in the requester's heap.

    Decoded (``layout``): feature blocks keep the batch's ``lengths`` / ``values`` with each feature's start
    ``vstart``; the general layout every value's global id and bag (``nbags`` bags). ``scale``: per-value weights
    (``None``: all 1 in the feature-block layout). Announced: ``msgs`` sent, ``requests`` received, ``buf`` the
    output buffer of this step; the partial bags ``p_counts`` per owner, and (general) each one's place ``bpos``
    in the ``[B * F, D]`` output, ``code`` (its place, -1 when summed here), ``direct`` and its owner ``p_src``.
    Pooled: ``served`` per requester ``(offsets, lengths, scales, partial bags)``, ``own_part`` /
    ``remote_parts`` the partial sums that go back through the transport. Gradients sent: ``grads``.
    """

    layout: IdsLayout = IdsLayout.GENERAL
    F: int = 0
    lengths: torch.Tensor | None = None
    values: torch.Tensor | None = None
    vstart: list[int] = field(default_factory=list)
    gids: torch.Tensor | None = None
    bag: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    nbags: int = 0
    buf: int = 0
    msgs: list[torch.Tensor] | None = None
    requests: list[torch.Tensor] | None = None
    p_counts: list[int] = field(default_factory=list)
    bpos: torch.Tensor | None = None
    code: torch.Tensor | None = None
    direct: torch.Tensor | None = None
    p_src: torch.Tensor | None = None
    out: torch.Tensor | None = None
    served: list[tuple] | None = None
    own_part: torch.Tensor | None = None
    sends: dict | None = None
    remote_parts: list[torch.Tensor] | None = None
    grads: list[torch.Tensor] | None = None
