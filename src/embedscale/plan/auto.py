"""``--strategy auto``: every table's form chosen under per-rank device and host memory budgets (numpy only).

For every table it weighs the forms the executor can build:

* ``replicated``: the whole table on every rank, exact (OPER section 4.3's replication taken to a table);
  its gradient rows are all-reduced every step;
* ``sharded``: exact rows placed on the ranks by OPER (sections 4.1-4.2), a batch's remote rows fetched
  once and their gradients sent back;
* ``tt`` of a rank from a candidate list (EL-Rec section III): the cores on every rank, their gradients
  all-reduced (EL-Rec VI-B); a table with hot rows (a global batch reads each at least ``hot_row_touch`` times)
  is TT as *row groups* only (:func:`hybrid_candidate`): those rows exact on every rank and only the others TT
  (``embedding.hybrid``; the plan carries the index reordering whose first ids are those rows, EL-Rec IV);
* ``host``: the rows in the host parameter server (EL-Rec section V; one copy per rank), every batch's
  distinct rows read and prefetched to the device, the life-cycle cache (V-B) holding the rows of the last
  ``pipeline_depth`` batches, sized from the table's miss-ratio curve (:mod:`embedscale.plan.mrc`).

**Cost model.** Per rank and step, with ``L`` the table's lookups per rank batch (profile: lookups per
sample times the batch), ``D_r`` / ``D_g`` the expected distinct rows of a rank's / the global batch
(:class:`~embedscale.plan.mrc.MissRatioCurve`, the per-batch deduplicated traffic the executor pays) and
the per-row costs of :class:`Costs` (measured by ``embedscale calibrate``; documented defaults otherwise):

    replicated:  L * exact + D_g * row_bytes * 2 (M-1)/M / allreduce_bw
    sharded:     L * exact + 2 * D_r * (M-1)/M * row_bytes / link_bw
    tt(R):       L * tt(R) + core_bytes * 2 (M-1)/M / allreduce_bw
    tt(R), H hot rows exact (a / d: their share of the lookups / of the batch's distinct rows):
                 a L * exact + (1-d) L * tt(R) + (core_bytes + H row_bytes) * 2 (M-1)/M / allreduce_bw + overhead
    host(k):     L * exact + (D_r + D_g) * host_row + 2 * D_g * row_bytes * (M-1)/M / link_bw

each plus, on several ranks, the executor's own work per table of its form (``Costs.executor_overhead``:
fitted from real N-rank steps by ``embedscale calibrate --ranks N``; 0 when not measured),
plus the link latency once per exchange a step runs (:func:`exchange_latency`, once per kind of table in the
plan: not separable by table), plus, with any host table, the host form's executor cost per step
(:meth:`Costs.host_step_overhead`) and with host and TT tables both, what the two cost beside each other
(:meth:`Costs.host_tt_step_overhead`), and memory per rank: replicated ``N (row + state)``, sharded ``N (row + state) / M``, tt its cores and
row-wise state (with ``H`` hot rows: plus ``H (row + state)``), host ``N (row + state)`` in host memory plus ``(k D_r + (k-1) D_g) (row + state)`` on the
device (prefetched rows and the life-cycle cache). The objective is the bottleneck rank's predicted step time
(the model is symmetric across ranks; after OPER places the sharded tables the report evaluates each rank).

**Search.** :func:`search_greedy`: Lagrangian starts (every table's form minimising seconds plus priced bytes,
for a grid of prices per tier), each repaired to the budgets by the moves that buy the most bytes (over the
tiers that overflow) per second lost and improved by single form changes; the best one then improved by
single and paired changes until none helps. :func:`search_milp` solves the same multiple-choice knapsack exactly with HiGHS
(``scipy.optimize.milp``) for checking on small cases. The terms a plan pays once per kind of table (latencies,
host step) are weighed by :func:`best_over_kinds`: the search again with each set of kinds left out, the choice
of least :func:`plan_seconds` kept (exact with the MILP). When nothing fits, :class:`BudgetError` names the
bytes over per tier and the tables that could not be placed.

**Quality guard**: a table whose rows are hot (the global batch reads it at least
``hot_touch`` times per row on average, lookups / rows; or it has fewer than ``tt_min_rows`` rows) stays
exact: never TT; within a TT table, the rows a global batch reads at least ``hot_row_touch`` times each stay
exact (row groups). A TT form records its
rank in the plan (``TableForm.tt_rank``).

The planner is split by concern, and this module gathers their public names: the measured costs
(:mod:`~embedscale.plan.auto_costs`), the candidates (:mod:`~embedscale.plan.auto_candidates`), the search
(:mod:`~embedscale.plan.auto_search`), the decision (:mod:`~embedscale.plan.auto_decide`) and the report
(:mod:`~embedscale.plan.auto_report`); sizes are read by :mod:`embedscale.units`.
"""

from __future__ import annotations

from embedscale.plan.auto_candidates import (DEFAULT_HOT_ROW_TOUCH, DEFAULT_TT_RANKS, MAX_HOT_ROW_SHARE,
                                             STATE_BYTES_PER_ROW, Candidate, TableStats, candidates,
                                             hybrid_candidate, table_stats, tt_core_bytes)
from embedscale.plan.auto_costs import (COSTS_FORMAT, EXECUTOR_TERMS, STEP_TERMS, CandidateKind, Costs,
                                        exchange_latency_of, executor_overheads_text, kind_of, load_costs,
                                        step_terms)
from embedscale.plan.auto_decide import AutoResult, best_over_kinds, decide, plan_seconds
from embedscale.plan.auto_report import (exchange_latency, explain, explain_text, rank_breakdown, summarize_choice,
                                         write_explain, write_memory_png)
from embedscale.plan.auto_search import BudgetError, budget_error, fits, search_greedy, search_milp
from embedscale.units import human_bytes, parse_bytes

__all__ = [
    "COSTS_FORMAT", "DEFAULT_HOT_ROW_TOUCH", "DEFAULT_TT_RANKS", "EXECUTOR_TERMS", "MAX_HOT_ROW_SHARE",
    "STATE_BYTES_PER_ROW", "STEP_TERMS", "AutoResult", "BudgetError", "Candidate", "CandidateKind", "Costs",
    "TableStats", "best_over_kinds", "budget_error", "candidates", "decide", "exchange_latency",
    "exchange_latency_of", "executor_overheads_text", "explain", "explain_text", "fits", "human_bytes",
    "hybrid_candidate", "kind_of", "load_costs", "parse_bytes", "plan_seconds", "rank_breakdown", "search_greedy",
    "search_milp", "step_terms", "summarize_choice", "table_stats", "tt_core_bytes", "write_explain",
    "write_memory_png",
]
