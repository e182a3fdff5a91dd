"""Input-aware planning (OPER): cost model, strategies, the ``Plan`` contract, reports and drift.

Entry points: ``embedscale.plan.api.make_plan`` / ``compare`` / ``plan_command`` /
``topology_command`` / ``drift_command``; the plan itself is ``embedscale.plan.plan.Plan``.
"""

from embedscale.plan.api import STRATEGIES, compare, make_plan, plan_command, topology_command
from embedscale.plan.drift import drift_command
from embedscale.plan.cost import Cost, evaluate
from embedscale.plan.plan import Plan, PlanError
from embedscale.plan.topology import LinkTopology

__all__ = ["STRATEGIES", "Cost", "LinkTopology", "Plan", "PlanError", "compare", "drift_command", "evaluate",
           "make_plan", "plan_command", "topology_command"]
