"""The output formats (``QuantConfig.output``): one module per format, each registering itself here.

Everything that lists formats — ``/v1/info.output_formats``, the CLI's ``--format``, the pipeline's
choice of writer — asks this registry. The wire vocabulary (``quantd_client._dtypes.OUTPUT_FORMATS``, the
config's ``output`` literal, in the client that cannot import the service) must name exactly the
registered formats: checked when this package is imported. Adding a format is one module here plus its
name in that tuple.
"""

from __future__ import annotations

from typing import TypeVar

from quantd_client._dtypes import OUTPUT_FORMATS

from .base import ModelStructure, OutputFormat, PlannedTensor, Sink

_REGISTRY: dict[str, OutputFormat] = {}
_F = TypeVar("_F", bound=type[OutputFormat])


def register(cls: _F) -> _F:
    """Class decorator: registers one instance of an output format under its ``name``."""
    if cls.name in _REGISTRY:
        raise RuntimeError(f"output format {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get_format(name: str) -> OutputFormat:
    """The registered format called ``name`` (KeyError naming the known ones otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown output format {name!r}; expected one of {sorted(_REGISTRY)}") from None


def artifact_suffix(name: str) -> str:
    """The name ending of a single-file artifact of format ``name``: quantd's own keeps v1's
    ``.quantd.safetensors``; the others end in their own suffix (``.gguf``)."""
    return ".quantd.safetensors" if name == "safetensors" else get_format(name).suffix


def format_names() -> list[str]:
    """The registered formats' names, in registration order."""
    return list(_REGISTRY)


# The format modules: importing one registers it.
from . import compressed_tensors, gguf, safetensors  # noqa: E402

if set(_REGISTRY) != set(OUTPUT_FORMATS):
    raise RuntimeError(f"output formats registered {sorted(_REGISTRY)} differ from the wire schema's "
                       f"{sorted(OUTPUT_FORMATS)} (quantd_client._dtypes.OUTPUT_FORMATS)")

__all__ = [
    "ModelStructure",
    "OutputFormat",
    "PlannedTensor",
    "Sink",
    "compressed_tensors",
    "format_names",
    "get_format",
    "gguf",
    "register",
    "safetensors",
]
