"""Errors of the jobs layer; the HTTP layer maps each class to a status (``quantd.server.problems``)."""

from __future__ import annotations

from quantd.errors import QuantdError


class JobNotFound(QuantdError):
    """No such job for this tenant (another tenant's job is reported the same way)."""

    title = "Job not found"
    type_ = "urn:quantd:job-not-found"


class JobFileNotFound(QuantdError):
    """A path that is not one of a job's output files."""

    title = "File not found"
    type_ = "urn:quantd:file-not-found"


class JobNotReady(QuantdError):
    """The report or artifact was asked for before the job succeeded."""

    title = "Job not ready"
    type_ = "urn:quantd:job-not-ready"


class JobExpired(QuantdError):
    """The job's files were deleted (TTL sweep, or DELETE after it finished); the job row stays."""

    title = "Job files expired"
    type_ = "urn:quantd:job-expired"


class IdempotencyConflict(QuantdError):
    """An idempotency key reused with a different input or config."""

    title = "Idempotency key reused"
    type_ = "urn:quantd:idempotency-conflict"


class QueueFull(QuantdError):
    """Too many queued jobs; retry after ``retry_after`` seconds."""

    title = "Queue full"
    type_ = "urn:quantd:queue-full"

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class DatabaseUnavailable(QuantdError):
    """The job database could not be reached, or dropped the connection, under a request: retry later."""

    title = "Database unavailable"
    type_ = "urn:quantd:database-unavailable"
    retry_after = 5

    def __init__(self, detail: str = "the job database is unavailable; retry later") -> None:
        super().__init__(detail)


class InvalidListQuery(QuantdError):
    """A bad ``status``, ``limit`` or ``cursor`` in a job listing."""

    title = "Invalid query"
    type_ = "urn:quantd:invalid-query"
    location = "query"


class StorageError(QuantdError):
    """A storage path outside the data dir, or a file the job needs that is gone: a server fault."""

    title = "Storage error"
    type_ = "urn:quantd:storage-error"


class SourceForbidden(QuantdError):
    """A job by reference naming a URL outside the tenant's allowed prefixes, or not an ``s3://`` URL: never
    fetched."""

    title = "Source not allowed"
    type_ = "urn:quantd:source-forbidden"


class SourceInvalid(QuantdError):
    """A job by reference whose source cannot be used: a prefix, a missing object."""

    title = "Source cannot be read"
    type_ = "urn:quantd:source-invalid"


class DestinationInvalid(QuantdError):
    """A job by reference whose destination cannot take its output (a directory output needs a prefix)."""

    title = "Destination cannot be written"
    type_ = "urn:quantd:destination-invalid"
