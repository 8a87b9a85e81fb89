"""Training and rollout on separate pools of processes, started by Ray and driven by one controller.

`run.placement=split` (with `run.pools.train` and `run.pools.rollout` workers):
Ray starts each pool's workers (cluster.py), each pool forms its own
torch.distributed group and builds the same engines as a colocated run
(workers.py), and one process drives the loop (driver.py), with the rollout of
the next steps overlapping training when `algorithm.off_policy_steps` > 0.
Weights cross between the pools through the core's reshard plan over a link
between them (`gearshift.reshard.pools`).
"""

from .cluster import WorkerError, WorkerLost
from .driver import SplitController

__all__ = ["SplitController", "WorkerError", "WorkerLost"]
