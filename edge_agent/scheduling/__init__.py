"""Per-model scheduling: the scheduler core (priority levels, deadlines, admission, dynamic batching; pure, with an
injected clock), the asyncio worker that runs its batches on executor threads, and the statistics with the one
outcome recorder per request."""

from edge_agent.scheduling.core import LevelPolicy, Pending, Rejection, Scheduler, SchedulerConfig
from edge_agent.scheduling.stats import ModelStats, RequestOutcome
from edge_agent.scheduling.worker import ExecutionFailed, ModelWorker, Refused, Served

__all__ = [
    "ExecutionFailed",
    "LevelPolicy",
    "ModelStats",
    "ModelWorker",
    "Pending",
    "Refused",
    "Rejection",
    "RequestOutcome",
    "Scheduler",
    "SchedulerConfig",
    "Served",
]
