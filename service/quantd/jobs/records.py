"""The job record as stored, and its conversion to the wire ``Job``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from quantd_client import Job
from quantd_client._schemas import STORED

TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", "running", *TERMINAL)


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant: str
    status: str
    config: dict[str, Any]
    input: dict[str, Any]
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    device: str | None
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    heartbeat_at: float | None
    idempotency_key: str | None
    cancel_requested: bool
    expired_at: float | None
    calibration: dict[str, Any] | None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_row(cls, row: Any) -> JobRecord:
        def js(key: str) -> Any:
            return None if row[key] is None else json.loads(row[key])

        return cls(
            id=row["id"], tenant=row["tenant"], status=row["status"], config=js("config"), input=js("input"),
            progress=js("progress") or {}, result=js("result"), error=js("error"), device=row["device"],
            attempts=row["attempts"], max_attempts=row["max_attempts"], lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"], created_at=row["created_at"],
            started_at=row["started_at"], finished_at=row["finished_at"], heartbeat_at=row["heartbeat_at"],
            idempotency_key=row["idempotency_key"], cancel_requested=bool(row["cancel_requested"]),
            expired_at=row["expired_at"], calibration=js("calibration"),
        )

    def to_job(self) -> Job:
        return Job.model_validate({
            "id": self.id, "status": self.status, "created_at": _dt(self.created_at),
            "started_at": _dt(self.started_at), "finished_at": _dt(self.finished_at),
            "input": self._input(), "config": self.config, "progress": self.progress, "device": self.device,
            "result": self.result, "error": self.error, "attempts": self.attempts,
            "cancel_requested": self.cancel_requested, "expired_at": _dt(self.expired_at),
            "source": self.input.get("source"), "destination": self.input.get("destination"),
        }, context=STORED)  # (a config an older release took is shown as stored: see _as_stored)

    def _input(self) -> dict[str, Any]:
        """The input as accepted; a job by reference's sha256 (and its files') once its worker has read the
        source, from the result (the object is not read before the job is accepted)."""
        result = self.result or {}
        if self.input.get("sha256") or not result.get("input_sha256"):
            return self.input
        hashes = result.get("input_files_sha256") or {}
        files = self.input.get("files")
        return {**self.input, "sha256": result["input_sha256"],
                **({"files": [{**f, "sha256": hashes.get(f["path"], f["sha256"])} for f in files]} if files else {})}


def _dt(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=timezone.utc)
