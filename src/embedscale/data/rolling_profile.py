"""RollingProfile: decayed per-row access counts kept while training.

OPER plans once from a profile of the whole dataset (OPER section 3) and names re-planning when the
input drifts as future work (section 8). On a stream the profile must follow the input: each rank
keeps, per table, an exponentially decayed access count per row,

    count_r  <-  count_r * decay^steps  +  new_r,

where ``new_r`` is the number of accesses of row ``r`` in the batch and ``steps`` the training steps
since the last update (1 per batch). ``decay = 1`` is a plain running count; ``decay = 0.5^(1/H)``
halves an access's weight every ``H`` steps. The decayed sample count follows the same rule.

Cost on the training path: ``O(batch)`` per table and update, on the run's device. The decay is kept
lazily as one scale factor (stored values are ``count * scale`` with ``scale = decay^-elapsed``, so an
update is an ``index_add_`` of the batch's rows scaled by ``scale``); the tables are rescaled in one
pass only when the scale passes ``1e150`` (``1e18`` in float32; the stored values stay finite and keep their relative
precision). Reading the counts costs one division per row. Two cheaper forms for a caller that counts every step
(the drift monitor): an update with no rows is the decay alone, kept as a step count and taken into the scale when
the profile is next used (no tensor touched); ``update_flat(..., defer=True)`` holds the batch's ids with the
step's scale and adds the held batches (an ``index_add_`` each, no copy) when the counts are next read (the same adds in the
same order: the same counts, bit for bit).

Across ranks: :meth:`RollingProfile.all_reduce` sums every rank's counts with one ``all_reduce`` of
one flat tensor through a given process group, when the drift monitor asks (not per step).
:meth:`RollingProfile.to_access_profile` gives an :class:`embedscale.data.profile.AccessProfile` of
float64 expected counts, the format ``plan/`` plans from.

Used by the drift monitor of an N-rank run (``train.replan``, ``train.replan_every``): each rank updates
its own per batch, and the monitor sums them every ``replan_every`` steps.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from embedscale.data.profile import AccessProfile
from embedscale.device import HOST
from embedscale.errors import ConfigError, FormatError, InputError

_RESCALE_AT = {torch.float64: 1e150, torch.float32: 1e18}  # stored values stay finite
_HOLD_IDS = 1 << 20  # update_flat(defer=True): held ids are added once this many wait (8 MiB of int64)


class RollingProfile:
    """Decayed per-row access counts of several tables on one device.

    Args:
        num_rows: table name -> rows.
        decay: per-step decay factor in ``(0, 1]``.
        device: the run's device (``train.device``; default: torch's default device).
        dtype: ``torch.float64`` (default; ``float32`` for devices without float64).

    Example::

        prof = RollingProfile({"C1": 1000}, decay=0.99)
        prof.update({"C1": rows})                  # once per batch, rows on the device
        total = prof.all_reduce(group)             # every rank's counts summed (a new RollingProfile)
        plan = make_plan("oper", tables, total.to_access_profile(), topology)
    """

    def __init__(self, num_rows: Mapping[str, int], decay: float, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float64):
        if not (0.0 < float(decay) <= 1.0):
            raise ConfigError(f"RollingProfile: decay must be in (0, 1], got {decay}")
        if dtype not in (torch.float64, torch.float32):
            raise ConfigError(f"RollingProfile: dtype must be float64 or float32, got {dtype}")
        bad = {n: r for n, r in num_rows.items() if int(r) < 1}
        if bad:
            raise ConfigError(f"RollingProfile: tables need at least one row, got {bad}")
        self.decay = float(decay)
        self.steps = 0
        self._scale = 1.0
        self._idle = 0  # steps counted in ``steps`` whose decay is not yet in the scale (:meth:`_sync`)
        self._samples = 0.0  # stored like the counts (times the scale)
        if not num_rows:
            raise ConfigError("RollingProfile: no tables")
        dev = torch.device(device) if device is not None else torch.get_default_device()
        self._hold(torch.zeros(sum(int(r) for r in num_rows.values()), dtype=dtype, device=dev), num_rows)

    def _hold(self, flat: torch.Tensor, num_rows: Mapping[str, int]) -> None:
        """Keep ``flat`` as the stored counts of the tables ``num_rows`` names, one after another."""
        sizes = [int(r) for r in num_rows.values()]
        self._flat = flat  # every table's counts, one after another
        self._counts = dict(zip(num_rows, torch.split(self._flat, sizes)))  # views of it, by table
        self.table_offsets = dict(zip(num_rows, itertools.accumulate([0, *sizes[:-1]])))  # each table's first row in :meth:`update_flat`'s ids
        self._ones: torch.Tensor | None = None  # update_flat's source (one access per id, scaled by alpha)
        self._held: list[tuple[torch.Tensor, float]] = []  # update_flat(defer=True): (ids, scale), not yet added
        self._held_ids = 0

    @property
    def table_names(self) -> list[str]:
        return list(self._counts)

    @property
    def num_rows(self) -> dict[str, int]:
        return {n: c.numel() for n, c in self._counts.items()}

    @property
    def device(self) -> torch.device:
        return next(iter(self._counts.values())).device

    def _table(self, name: str) -> torch.Tensor:
        try:
            return self._counts[name]
        except KeyError:
            raise InputError(f"rolling profile has no table {name!r}; tables: {self.table_names}") from None

    def _rescale(self) -> None:
        self._flush()  # the held batches' weights are in the current scale's units
        for c in self._counts.values():
            c.div_(self._scale)
        self._samples /= self._scale
        self._scale = 1.0

    def _advance(self, steps: int) -> None:
        """Decay by ``decay^steps``: grow the scale, rescaling the tables before it would pass the limit
        (in log space: ``decay^-steps`` alone may not fit a float)."""
        limit = math.log(_RESCALE_AT[next(iter(self._counts.values())).dtype])
        grow = -steps * math.log(self.decay)
        if math.log(self._scale) + grow > limit:
            self._rescale()
            if grow > limit:  # a long gap: decay the tables directly (may underflow to 0, never overflows)
                f = self.decay ** steps  # (the held batches were added by _rescale)
                for c in self._counts.values():
                    c.mul_(f)
                self._samples *= f
                return
        self._scale *= math.exp(grow)

    @torch.no_grad()
    def update(self, rows_by_table: Mapping[str, torch.Tensor], steps: int = 1, samples: int = 0,
               weight: float = 1.0) -> None:
        """Decay every table by ``decay^steps``, then add one access per row id of ``rows_by_table``
        (and ``samples`` to the sample count). Tables not named get only the decay; with no rows at all it is
        the decay alone, kept in the scale factor (no tensor touched: the drift monitor's batches not counted)."""
        if int(steps) < 0:
            raise ConfigError(f"RollingProfile.update: steps must be >= 0, got {steps}")
        if not rows_by_table:  # the decay alone: the steps are taken into the scale when it is next used
            self.decay_only(int(steps))
            if samples:
                self._sync()
                self._samples += samples * self._scale * weight
            return
        for name, rows in rows_by_table.items():  # check all before changing anything
            c = self._table(name)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= c.numel()):
                bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
                raise InputError(f"rolling profile: table {name!r}: row {bad} outside 0..{c.numel() - 1}")
        flat = [rows.reshape(-1).to(self._flat.device, torch.int64) + self.table_offsets[name]
                for name, rows in rows_by_table.items()]
        ids = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64, device=self._flat.device)
        self.update_flat(ids, steps, samples, check=False, weight=weight)

    def decay_only(self, steps: int = 1) -> None:
        """:meth:`update` with no rows and no samples: ``steps`` of decay, kept as a step count and taken into the
        scale when the profile is next used (plain Python, no tensor and no grad mode touched)."""
        self.steps += steps
        self._idle += steps

    def _decay_steps(self, steps: int) -> None:
        self.decay_only(steps)
        self._sync()

    def _sync(self) -> None:
        """Take the steps decayed without a count (:meth:`update` with no rows) into the scale."""
        if self._idle:
            steps, self._idle = self._idle, 0
            if self.decay < 1.0:
                self._advance(steps)

    @torch.no_grad()
    def update_flat(self, ids: torch.Tensor, steps: int = 1, samples: int = 0, check: bool = True,
                    defer: bool = False, weight: float = 1.0) -> None:
        """:meth:`update` with the rows of every table in one tensor: ``ids`` index the tables' rows laid one
        after another in :attr:`table_names` order (row ``r`` of table ``t`` is ``table_offsets[t] + r``), so a
        batch is counted in one ``index_add_`` (the drift monitor's per-batch path). ``check``: refuse ids outside
        the whole range (a caller that checked each table's range itself passes ``False``). Same counts, bit for
        bit, as :meth:`update` with the ids split by table. ``defer``: hold ``ids`` (not copied: the caller must not
        change them) with the step's scale and add the held batches (an ``index_add_`` each) when the counts are next
        read or the scale is reset (:meth:`_flush`): the same adds in the same order, so the same counts bit for bit,
        at one list append a batch. ``weight``: each id (and each sample) counts this many accesses (a batch
        sampled with probability ``1 / weight``: the expected count is the full one)."""
        if int(steps) < 0:
            raise ConfigError(f"RollingProfile.update_flat: steps must be >= 0, got {steps}")
        if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device != self._flat.device:
            ids = ids.reshape(-1).to(self._flat.device, torch.int64)
        if check and ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self._flat.numel():
                bad = int(lo) if int(lo) < 0 else int(hi)
                raise InputError(f"rolling profile: row {bad} outside the tables' 0..{self._flat.numel() - 1}")
        self._decay_steps(int(steps))
        if defer:
            self._held.append((ids, self._scale * weight))
            self._held_ids += ids.numel()
            self._samples += samples * self._scale * weight
            if self._held_ids >= _HOLD_IDS:  # a bound on the memory held between reads
                self._flush()
            return
        self._flat.index_add_(0, ids, self._ones_of(ids.numel()), alpha=self._scale * weight)
        self._samples += samples * self._scale * weight

    def _ones_of(self, n: int) -> torch.Tensor:
        """``n`` ones of the counts' dtype (a kept buffer: the source of an ``index_add_`` scaled by its alpha)."""
        if self._ones is None or self._ones.numel() < n:
            self._ones = torch.ones(max(n, 1024), dtype=self._flat.dtype, device=self._flat.device)
        return self._ones[:n]

    @torch.no_grad()
    def _flush(self) -> None:
        """Add the batches :meth:`update_flat` held (``defer``), in their order: each batch's own ``index_add_`` of
        ones scaled by its step's scale (the adds it would have made at its step; no concatenation or weight vector
        built: 3-5x less CPU than one ``index_add_`` over the concatenated batches, measured)."""
        if not self._held:
            return
        held, self._held, self._held_ids = self._held, [], 0
        for ids, sc in held:
            self._flat.index_add_(0, ids, self._ones_of(ids.numel()), alpha=sc)

    def counts(self, name: str) -> torch.Tensor:
        """The decayed count of every row of table ``name`` (a new tensor on the device)."""
        self._sync()
        self._flush()
        return self._table(name) / self._scale

    @property
    def samples(self) -> float:
        """The decayed number of samples counted."""
        self._sync()
        return self._samples / self._scale

    @torch.no_grad()
    def all_reduce(self, group: dist.ProcessGroup | None = None) -> "RollingProfile":
        """Every rank's counts summed (one ``all_reduce`` of one flat tensor through ``group``).

        Collective: every rank of ``group`` calls it with the same tables. Returns a new profile; this
        rank's own counts are unchanged."""
        return self.all_reduce_async(group)()

    @torch.no_grad()
    def all_reduce_async(self, group: dist.ProcessGroup | None = None) -> Callable[[], "RollingProfile"]:
        """:meth:`all_reduce` started now on a snapshot of the counts (this rank may go on updating them):
        returns the function that waits for it and returns the summed profile (any thread may call it)."""
        names = self.table_names
        self._sync()
        self._flush()
        flat = torch.empty(self._flat.numel() + 1, dtype=self._flat.dtype, device=self.device)
        torch.div(self._flat, self._scale, out=flat[:-1])  # every table's counts (the tables laid end to end)
        flat[-1] = self.samples
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        sizes, decay, steps, dtype = [self._counts[n].numel() for n in names], self.decay, self.steps, flat.dtype

        def summed() -> "RollingProfile":
            work.wait()
            out = RollingProfile({names[0]: 1}, decay, self.device, dtype)
            out._hold(flat[:-1], dict(zip(names, sizes)))  # the received sum itself, no copy
            out.steps = steps
            out._samples = float(flat[-1])
            return out
        return summed

    def to_access_profile(self, feature_to_table: Mapping[str, str] | None = None) -> AccessProfile:
        """An :class:`AccessProfile` of float64 expected counts (its ``samples`` is the decayed sample
        count rounded to an integer), the input of ``plan.api.make_plan``."""
        tables = {n: self.counts(n).to(HOST, torch.float64).numpy() for n in self.table_names}
        return AccessProfile(tables, int(round(self.samples)), feature_to_table)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(..., weights_only=True)``): the stored (scaled) counts by table and
        ``meta = [decay, steps, stored samples, scale]``, so a restored profile continues bit for bit as the
        saved one would have (a checkpoint's, ``train.replan``)."""
        self._sync()
        self._flush()
        out = {f"stored.{n}": c.clone() for n, c in self._counts.items()}
        out["meta"] = torch.tensor([self.decay, float(self.steps), self._samples, self._scale], dtype=torch.float64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """A :meth:`state_dict` (or an older one: decayed ``counts.<table>`` and a 3-entry ``meta``)."""
        if "meta" not in state:
            raise FormatError("rolling profile state: 'meta' is missing")
        meta = state["meta"].tolist()
        decay, steps, samples, scale = meta if len(meta) == 4 else (*meta, 1.0)
        if decay != self.decay:
            raise FormatError(f"rolling profile state: decay {decay} differs from this profile's {self.decay}")
        prefix = "stored" if len(meta) == 4 else "counts"
        for n, c in self._counts.items():
            key = f"{prefix}.{n}"
            if key not in state or tuple(state[key].shape) != tuple(c.shape):
                got = tuple(state[key].shape) if key in state else "missing"
                raise FormatError(f"rolling profile state: table {n!r}: {got}, expected {tuple(c.shape)}")
        self._held, self._held_ids, self._idle = [], 0, 0  # replaced by the state's counts
        for n, c in self._counts.items():
            c.copy_(state[f"{prefix}.{n}"])
        self._scale = float(scale)
        self.steps = int(steps)
        self._samples = float(samples)

    @torch.no_grad()
    def add_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Add another rank's profile (a :meth:`state_dict` of the same tables, decay and steps) to this one:
        the sum the monitor's :meth:`all_reduce` would take, kept on one rank (a checkpoint restored on another
        world size)."""
        other = RollingProfile({n: c.numel() for n, c in self._counts.items()}, self.decay, self.device,
                               next(iter(self._counts.values())).dtype)
        other.load_state_dict(state)
        if other.steps != self.steps:
            raise FormatError(f"rolling profile state: {other.steps} steps, this profile {self.steps}")
        self._sync()
        self._flush()
        for n, c in self._counts.items():
            c.add_(other.counts(n).to(c.device), alpha=self._scale)
        self._samples += other.samples * self._scale

