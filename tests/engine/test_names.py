"""The names of dtypes, observers, granularities and methods are defined once, by the wire schema's
Literals: the engine's tables and registries implement exactly those, and everything that lists them is
derived from them."""

from __future__ import annotations

from typing import get_args

from quantd.engine.observers import OBSERVERS
from quantd_client._dtypes import DTYPES, SCALE_DTYPES
from quantd_client._schemas import _OBSERVER_ARGS, DType, ObserverName, ScaleDType


def test_the_observer_registry_implements_exactly_the_schema_names() -> None:
    assert sorted(OBSERVERS) == sorted(get_args(ObserverName))
    assert sorted(_OBSERVER_ARGS) == sorted(get_args(ObserverName))  # each name's arguments


def test_the_dtype_table_implements_exactly_the_schema_names() -> None:
    assert list(DTYPES) == list(get_args(DType))
    assert get_args(ScaleDType) == SCALE_DTYPES


def test_the_cli_offers_the_schema_names() -> None:
    from quantd.cli import build_parser

    quantize = build_parser()._subparsers._group_actions[0].choices["quantize"]  # type: ignore[union-attr]
    by_flag = {a.option_strings[0]: a for a in quantize._actions if a.option_strings}
    assert tuple(by_flag["--observer"].choices) == get_args(ObserverName)
    assert by_flag["--dtype"].help == "|".join(get_args(DType))


def test_the_name_tuples_of_the_dtype_table_are_the_schema_names() -> None:
    from quantd_client import _dtypes, _schemas

    assert get_args(_schemas.MethodName) == _dtypes.METHODS
    assert get_args(ObserverName) == _dtypes.OBSERVERS
    assert get_args(_schemas.GranularityName) == _dtypes.GRANULARITIES
    assert get_args(_schemas.InputFormat) == _dtypes.INPUT_FORMATS
