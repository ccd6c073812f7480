"""Typed results: the same content as the CLI's `--json` documents (`raw` keeps all of it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class RankRow:
    """One rank of a consistency report."""

    worker: int
    dp: int
    tp: int
    host: str
    pid: int
    address: str
    checkpoint_version: str
    kernel_rank_digest: str
    layout_identity: str
    round_trip_ok: bool
    # Empty when the rank ran its round trip; else the verified rank ("dp0/tp1") whose verdict
    # it adopted, its kernel and source digests being equal (a later replica of an update).
    round_trip_identical_to: str
    load_seconds: float
    load_path: str
    verdict: str
    spare_buffers: bool
    failure: Optional[str]

    @property
    def label(self) -> str:
        return f"dp{self.dp}/tp{self.tp}"

    @classmethod
    def from_json(cls, d: dict) -> "RankRow":
        return cls(
            worker=int(d["worker"]),
            dp=int(d["dp"]),
            tp=int(d["tp"]),
            host=d.get("host", ""),
            pid=int(d.get("pid", 0)),
            address=d.get("address", ""),
            checkpoint_version=d.get("checkpoint_version", ""),
            kernel_rank_digest=d.get("kernel_rank_digest", ""),
            layout_identity=d.get("layout_identity", ""),
            round_trip_ok=bool(d.get("round_trip_ok", False)),
            round_trip_identical_to=d.get("round_trip_identical_to", ""),
            load_seconds=float(d.get("load_seconds", 0.0)),
            load_path=d.get("load_path", ""),
            verdict=d.get("verdict", ""),
            spare_buffers=bool(d.get("spare_buffers", False)),
            failure=d.get("failure"),
        )


@dataclass(frozen=True)
class Rule:
    """One cross-rank rule's verdict."""

    id: str
    rule: str
    ok: bool
    findings: list[str]

    @classmethod
    def from_json(cls, d: dict) -> "Rule":
        return cls(id=d.get("id", ""), rule=d["rule"], ok=bool(d["ok"]), findings=list(d.get("findings", [])))


@dataclass(frozen=True)
class Report:
    """`orchestrator report --json`."""

    ok: bool
    tp_size: int
    dp_size: int
    source: str
    ranks: list[RankRow]
    rules: list[Rule]
    notes: list[str]
    text: str
    raw: dict[str, Any] = field(repr=False)

    @property
    def versions(self) -> dict[int, str]:
        """The checkpoint version each replica's ranks hold (empty when they disagree)."""
        out: dict[int, str] = {}
        for dp in sorted({r.dp for r in self.ranks}):
            held = {r.checkpoint_version for r in self.ranks if r.dp == dp}
            out[dp] = held.pop() if len(held) == 1 else ""
        return out

    @property
    def lost(self) -> list[RankRow]:
        """Ranks that did not answer (dead or silent)."""
        return [r for r in self.ranks if r.failure]

    @classmethod
    def from_json(cls, d: dict, text: str = "") -> "Report":
        return cls(
            ok=bool(d["ok"]),
            tp_size=int(d["tp_size"]),
            dp_size=int(d["dp_size"]),
            source=d.get("source", ""),
            ranks=[RankRow.from_json(r) for r in d.get("ranks", [])],
            rules=[Rule.from_json(r) for r in d.get("rules", [])],
            notes=list(d.get("notes", [])),
            text=text,
            raw=d,
        )


@dataclass(frozen=True)
class UpdateFailure:
    """Why an update did not finish with every replica on the new version (`update.failure`).

    `kind` is one of `pending_commit`, `invalid_checkpoint`, `changed_checkpoint`, `journal`,
    `internal` (refusals: `refused` is true, nothing was touched), `staged_rank_unreachable`,
    `staged_version`, `replica_digests`, `round_trip`, `probe_tolerance`, `replica_y`,
    `unhealthy_at_decision`, `commit_unconfirmed`, `probe_after_swap`, `ranks_dead`; `rank` names the rank whose
    check failed ("dp0/tp1"), `round_trip` a staged round trip's failures as (kind, tensor) pairs."""

    kind: str
    refused: bool
    replicas: list[int]
    rank: Optional[str]
    round_trip: list[tuple[str, Optional[str]]]
    why: str

    @classmethod
    def from_json(cls, d: dict) -> "UpdateFailure":
        return cls(
            kind=d["kind"],
            refused=bool(d.get("refused", False)),
            replicas=[int(r) for r in d.get("replicas", [])],
            rank=d.get("rank"),
            round_trip=[(f["kind"], f.get("tensor")) for f in d.get("round_trip", [])],
            why=d.get("why", ""),
        )


@dataclass(frozen=True)
class UpdateOutcome:
    """`orchestrator update --json`: the update's steps and the report after it."""

    ok: bool
    checkpoint: str
    new_version: str
    steps: list[str]
    versions: dict[int, str]
    seconds: float
    report: Report
    text: str
    raw: dict[str, Any] = field(repr=False)
    failure: Optional[UpdateFailure] = None

    @classmethod
    def from_json(cls, d: dict, text: str = "") -> "UpdateOutcome":
        u = d["update"]
        return cls(
            ok=bool(d["ok"]),
            checkpoint=u.get("checkpoint", ""),
            new_version=u.get("new_version", ""),
            steps=list(u.get("steps", [])),
            versions={int(k): v for k, v in u.get("versions", {}).items()},
            seconds=float(u.get("seconds", 0.0)),
            report=Report.from_json(d["report"]),
            text=text,
            raw=d,
            failure=UpdateFailure.from_json(u["failure"]) if u.get("failure") else None,
        )


@dataclass(frozen=True)
class ProbeLoad:
    """`orchestrator probe --json`: routed probes at a rate for a time."""

    ok: bool
    served: int
    failed: int
    seconds: float
    latency_ms: dict[str, float]
    by_replica: dict[str, dict[str, int]]
    by_version: dict[str, dict[str, int]]
    errors: list[str]
