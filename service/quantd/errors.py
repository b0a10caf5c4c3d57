"""Domain errors: raised by the engine, the readers and the jobs layer; mapped to HTTP by the routes.

Nothing below the routes raises ``HTTPException``, and no error here knows an HTTP status: the HTTP layer
maps each class to one (``quantd.server.problems``). Each carries a ``title``, a ``type_`` URN and a
``detail`` that names the tensor/field at fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class QuantdError(Exception):
    title: str = "Bad request"
    type_: str = "about:blank"
    location: str = "body"  # where a 422's field is: "body" (the multipart form) or "query"

    def __init__(self, detail: str, *, tensor: str | None = None, field: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.tensor = tensor
        self.field = field


class ConfigError(QuantdError):
    """A config that cannot apply to a tensor (group_size not dividing, bad axis, ...)."""

    title = "Config cannot apply"
    type_ = "urn:quantd:config-error"

    def __init__(self, detail: str, *, tensor: str | None = None, field: str | None = None) -> None:
        where = " ".join(p for p in (f"field {field!r}" if field else "", f"tensor {tensor!r}" if tensor else "") if p)
        super().__init__(f"{where}: {detail}" if where else detail, tensor=tensor, field=field)


class UnsupportedFormatError(QuantdError):
    title = "Unsupported media type"
    type_ = "urn:quantd:unsupported-format"


class UnsafeInputError(QuantdError):
    """A pickle that would need code to load: refused, never executed."""

    title = "Unsafe input refused"
    type_ = "urn:quantd:unsafe-input"


class MalformedInputError(QuantdError):
    """Truncated files, lying headers, overlapping or out-of-range offsets, shape mismatches."""

    title = "Malformed input"
    type_ = "urn:quantd:malformed-input"


def check_unicode(value: str, what: str) -> None:
    """MalformedInputError when ``value`` (a tensor name or other text from an input) has lone surrogates,
    which JSON's ``\\ud800`` escapes can make: no UTF-8 file, header or response could hold it. The message
    shows it escaped; the error names no tensor, since its name is the text that cannot be written."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedInputError(f"{what} {value!r} is not valid Unicode (it has a lone surrogate)") from None


class NonFiniteError(MalformedInputError):
    title = "Non-finite weights"
    type_ = "urn:quantd:non-finite"


class InputTooLargeError(QuantdError):
    title = "Payload too large"
    type_ = "urn:quantd:too-large"


class JobCancelled(QuantdError):
    title = "Job cancelled"
    type_ = "urn:quantd:cancelled"


@contextlib.contextmanager
def naming(part: str) -> Iterator[None]:
    """A QuantdError raised inside says which ``part`` of the request it concerns (``configs[3]``, the
    ``calibration`` file, ...): its detail gets ``part`` in front, its status and fields stay."""
    try:
        yield
    except QuantdError as e:
        e.detail = f"{part}: {e.detail}"
        e.args = (e.detail,)
        raise
