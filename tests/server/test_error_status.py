"""Domain errors carry no HTTP status: the HTTP layer maps every class to one."""

from __future__ import annotations

import importlib
import pkgutil

import quantd
from quantd.errors import ConfigError, NonFiniteError, QuantdError
from quantd.jobs.errors import JobExpired, QueueFull, StorageError
from quantd.server.problems import STATUS_OF, status_of


def _all_subclasses(cls: type) -> set[type]:
    out = set(cls.__subclasses__())
    for sub in list(out):
        out |= _all_subclasses(sub)
    return out


def test_no_domain_error_knows_an_http_status() -> None:
    for info in pkgutil.walk_packages(quantd.__path__, "quantd."):  # every module that may define one
        if not info.name.startswith("quantd.server") and not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    errors = _all_subclasses(QuantdError) | {QuantdError}
    assert len(errors) >= len(STATUS_OF)
    for cls in errors:
        assert not cls.__module__.startswith("quantd.server"), cls
        assert "status" not in vars(cls), f"{cls.__qualname__} sets an HTTP status: map it in server/problems.py"
        assert 400 <= status_of(cls) < 600


def test_each_error_maps_to_its_status() -> None:
    assert status_of(ConfigError("x")) == 422
    assert status_of(NonFiniteError("x")) == 422  # by its parent, MalformedInputError
    assert status_of(JobExpired("x")) == 410
    assert status_of(QueueFull("x", retry_after=3)) == 429
    assert status_of(StorageError("x")) == 500
    assert status_of(QuantdError("x")) == 400
