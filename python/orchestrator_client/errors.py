"""Typed errors of the client. Every error is an `OrchestratorError`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .types import UpdateOutcome


class OrchestratorError(Exception):
    """Base class. `code` is the gRPC status code name when the error came from a call."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.code = code


class Unauthenticated(OrchestratorError):
    """The coordinator refused the token (wrong or missing `token_file`)."""


class NotServing(OrchestratorError):
    """The cluster is still launching or recovering: nothing was started; try again."""


class CoordinatorUnavailable(OrchestratorError):
    """The coordinator cannot be reached (or went away mid-call)."""


class UpdateFailed(OrchestratorError):
    """A rolling update did not finish: `outcome` says which replicas hold which version (every
    TP group is on one version)."""

    def __init__(self, message: str, outcome: "UpdateOutcome"):
        super().__init__(message)
        self.outcome = outcome


class UpdateRefused(UpdateFailed):
    """The update was refused before any replica was touched (a bad checkpoint, another geometry,
    a path outside the allowed roots, an unfinished commit)."""


class RankLost(UpdateFailed):
    """A rank died before or during the update: `ranks` names them (`dp0/tp1 ...`)."""

    def __init__(self, message: str, outcome: "UpdateOutcome", ranks: list[str]):
        super().__init__(message, outcome)
        self.ranks = ranks
