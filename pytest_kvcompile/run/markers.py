"""Marker arguments are checked at collection, the same way for every kvcompile marker."""

from __future__ import annotations

import inspect
from typing import Callable

import pytest


def written(mark: pytest.Mark) -> str:
    """The marker as the test wrote it, e.g. ``@pytest.mark.limit_memory('64 MiB')``: every argument error starts with it."""
    given = ", ".join([*map(repr, mark.args), *(f"{k}={v!r}" for k, v in mark.kwargs.items())])
    return f"@pytest.mark.{mark.name}({given})"


def bind(signature: inspect.Signature, args: tuple, kwargs: dict, where: str, usage: str) -> inspect.BoundArguments:
    """Marker arguments bound to the marker's documented signature; ValueError naming the usage."""
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}; write {usage}") from None


def validated_at_collection(check: Callable[[pytest.Item], object]):
    """A ``pytest_pycollect_makeitem`` hook wrapper: when ``check(item)`` raises ValueError, collection
    of the module fails with the item and the message (a UsageError raised in an xdist worker would
    crash the worker instead of reporting)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object):
        result = yield
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, pytest.Item):
                try:
                    check(item)
                except ValueError as exc:
                    raise collector.CollectError(f"{item.nodeid}: {exc}") from None
        return result

    return pytest_pycollect_makeitem
