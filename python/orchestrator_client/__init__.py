"""Python client of an orchestrator cluster (see `Cluster`)."""

from .client import Cluster
from .errors import (
    CoordinatorUnavailable,
    NotServing,
    OrchestratorError,
    RankLost,
    Unauthenticated,
    UpdateFailed,
    UpdateRefused,
)
from .types import ProbeLoad, RankRow, Report, Rule, UpdateFailure, UpdateOutcome

__all__ = [
    "Cluster",
    "CoordinatorUnavailable",
    "NotServing",
    "OrchestratorError",
    "ProbeLoad",
    "RankLost",
    "RankRow",
    "Report",
    "Rule",
    "Unauthenticated",
    "UpdateFailed",
    "UpdateFailure",
    "UpdateOutcome",
    "UpdateRefused",
]
