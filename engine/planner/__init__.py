"""The planner: engine settings from a one-layer profile, a layer DAG and a replay of the scheduler.

profile (one layer on the device) -> cost curves -> for each candidate configuration, the real
scheduler replayed on page-less pools gives every step's shape -> the layer DAG's critical path
prices each step -> the configuration with the shortest predicted batch completion time wins.
"""

from batchgen.engine.planner.cost_curves import CostCurves, LinearCost
from batchgen.engine.planner.planner import PLANNED_FIELDS, Plan, plan_engine, resolve_config
from batchgen.engine.planner.workload import WorkloadShape

__all__ = ["PLANNED_FIELDS", "CostCurves", "LinearCost", "Plan", "WorkloadShape", "plan_engine", "resolve_config"]
