"""Shared steps of the upload routes: parse a JSON form field into its model, run io off the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from pydantic import TypeAdapter, ValidationError

from ..deps import AppState
from ..problems import ProblemException, form_validation_problem
from ..uploads import MultipartForm

T = TypeVar("T")


def parse_json_field(form: MultipartForm, field: str, adapter: TypeAdapter[T]) -> T:
    """The JSON text of form field ``field`` validated by ``adapter``; 422 naming the field otherwise."""
    raw = form.fields.get(field)
    if raw is None:  # as FastAPI answers a missing form field
        raise ProblemException(422, f"multipart body has no {field!r} field", title="Validation failed",
                               type_="urn:quantd:validation-error",
                               errors=[{"loc": ["body", field], "msg": "Field required"}])
    try:
        return adapter.validate_json(raw)
    except ValidationError as e:
        raise form_validation_problem(field, e) from None


async def run_engine(state: AppState, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking io/engine work in a worker thread, at most ``sync_concurrency`` at once."""
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=state.sync_limiter)


async def run_check(state: AppState, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a job submission's checks in a worker thread, at most ``sync_concurrency`` at once, apart from the
    synchronous quantizations (:func:`run_engine`): a long one never holds a submission."""
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=state.check_limiter)
