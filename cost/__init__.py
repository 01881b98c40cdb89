"""Cost models (sympy) of every strategy, the topology they are evaluated on, and the planner.

Nothing here imports torch.fx or Triton (DESIGN.md, layout table)."""

from moe_compile.cost.planner import Plan, plan
from moe_compile.cost.topology import EfficiencyCurve, Level, Topology
from moe_compile.cost.workload import Workload

__all__ = ["EfficiencyCurve", "Level", "Plan", "Topology", "Workload", "plan"]
