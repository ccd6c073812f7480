"""`Cluster`: the Coordinator service of a served cluster, over gRPC (TLS when the address is
https://), with the cluster's token."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import grpc

from ._proto import orchestrator_pb2 as pb
from ._proto import orchestrator_pb2_grpc as pb_grpc
from .errors import (
    CoordinatorUnavailable,
    NotServing,
    OrchestratorError,
    RankLost,
    Unauthenticated,
    UpdateFailed,
    UpdateRefused,
)
from .types import ProbeLoad, Report, UpdateOutcome

# The name the cluster's node certificate is issued for (`orchestrator tls generate`).
SERVER_NAME = "orchestrator.cluster"


def _error(e: grpc.RpcError, what: str) -> OrchestratorError:
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else None
    message = f"{what}: {e.details() if hasattr(e, 'details') else e}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message, name)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return NotServing(message, name)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return CoordinatorUnavailable(message, name)
    return OrchestratorError(message, name)


def _percentile(values: list[float], q: float) -> float:
    """Nearest rank, as the CLI computes it."""
    if not values:
        return 0.0
    v = sorted(values)
    rank = min(max(math.ceil(len(v) * q), 1), len(v))
    return v[rank - 1]


class Cluster:
    """A served cluster's coordinator.

    `address`: `http://HOST:PORT` or `https://HOST:PORT` (what `launch --serve` prints);
    `token_file`: the cluster's token file; `tls_dir`: the cluster's TLS directory (its
    `ca.pem`), needed for https.
    """

    def __init__(self, address: str, token_file: Union[str, Path], tls_dir: Union[str, Path, None] = None):
        scheme, _, target = address.partition("://")
        if not target:
            scheme, target = "http", address
        token = Path(token_file).read_text().strip()
        if len(token) < 16:
            raise OrchestratorError(f"{token_file}: the token has {len(token)} characters; the cluster's has at least 16")
        self._metadata = (("authorization", f"Bearer {token}"),)
        if scheme == "https":
            if tls_dir is None:
                raise OrchestratorError(f"{address}: an https coordinator needs tls_dir (the cluster's TLS directory)")
            ca = (Path(tls_dir) / "ca.pem").read_bytes()
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self._channel = grpc.secure_channel(target, creds, options=(("grpc.ssl_target_name_override", SERVER_NAME),))
        elif scheme == "http":
            self._channel = grpc.insecure_channel(target)
        else:
            raise OrchestratorError(f"{address}: the scheme must be http or https")
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.address = address

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self, probe: bool = True, timeout: float = 600.0) -> Report:
        """Re-runs the cross-rank checks (and, with `probe`, the probes): the consistency report."""
        try:
            r = self._stub.Report(pb.ClusterReportRequest(probe=probe), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, "report") from None
        return Report.from_json(json.loads(r.json), r.text)

    def update(
        self,
        checkpoint: Union[str, Path],
        max_unavailable: int = 1,
        timeout: float = 3600.0,
        max_staging: Optional[int] = None,
    ) -> UpdateOutcome:
        """Rolls `checkpoint` (same geometry) across the replicas, `max_unavailable` at a time, each
        verified before its all-ranks swap; every replica stages at once beside the weights it
        serves (`max_staging` bounds how many). Returns the outcome on success; raises
        `UpdateRefused` (nothing touched), `RankLost` or `UpdateFailed` (each with the outcome)
        otherwise."""
        if max_unavailable < 1:
            raise OrchestratorError("max_unavailable must be at least 1")
        if max_staging is not None and max_staging < 1:
            raise OrchestratorError("max_staging must be at least 1")
        directory = str(Path(checkpoint).resolve())
        req = pb.UpdateRequest(checkpoint_dir=directory, max_unavailable=max_unavailable, max_staging=max_staging or 0)
        try:
            r = self._stub.Update(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, "update") from None
        outcome = UpdateOutcome.from_json(json.loads(r.json), r.text)
        if outcome.ok:
            return outcome
        failure = outcome.failure
        why = failure.why if failure is not None else "the update failed"
        if failure is not None and failure.refused:
            raise UpdateRefused(f"update of {directory}: {why}", outcome)
        lost = [r.label for r in outcome.report.lost]
        if lost or (failure is not None and failure.kind == "ranks_dead"):
            raise RankLost(f"update of {directory}: ranks lost: {', '.join(lost) or why}", outcome, lost)
        raise UpdateFailed(f"update of {directory}: {why}", outcome)

    def probe(self, rate: float, duration: float, tokens: int = 2, latents: int = 16, seed: int = 0) -> ProbeLoad:
        """`rate` routed probes a second for `duration` seconds, each sent on time whatever the
        others are doing: counts per replica and version, latency percentiles."""
        if not (0 < rate <= 1000):
            raise OrchestratorError("rate must be in (0, 1000]")
        if not (0 < duration <= 86400):
            raise OrchestratorError("duration must be in (0, 86400] seconds")
        count = math.ceil(rate * duration)
        samples: list[tuple[float, bool, str, str, str]] = []
        lock = threading.Lock()
        req = pb.RoutedProbeRequest(tokens=tokens, latents=latents, seed=seed)

        def one() -> None:
            t = time.monotonic()
            try:
                r = self._stub.RoutedProbe(req, timeout=60, metadata=self._metadata)
                sample = (1e3 * (time.monotonic() - t), r.ok, f"dp{r.replica}", r.checkpoint_version, r.error)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise _error(e, "probe") from None
                sample = (1e3 * (time.monotonic() - t), False, "-", "-", e.details() or str(e.code()))
            with lock:
                samples.append(sample)

        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(64, count)) as pool:
            futures = []
            for i in range(count):
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one))
            for f in futures:
                f.result()
        seconds = time.monotonic() - start

        def counts(key: int) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for s in samples:
                e = out.setdefault(s[key], {"served": 0, "failed": 0})
                e["served" if s[1] else "failed"] += 1
            return dict(sorted(out.items()))

        latencies = [s[0] for s in samples]
        served = sum(1 for s in samples if s[1])
        return ProbeLoad(
            ok=served == len(samples),
            served=served,
            failed=len(samples) - served,
            seconds=seconds,
            latency_ms={k: _percentile(latencies, q) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
            by_replica=counts(2),
            by_version=counts(3),
            errors=[s[4] for s in samples if not s[1]][:10],
        )

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops every worker, then the coordinator."""
        try:
            self._stub.Shutdown(pb.ShutdownRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, "shutdown") from None
