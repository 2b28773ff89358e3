"""Marker arguments are checked at collection, the same way for every kvcompile marker."""

from __future__ import annotations

from typing import Callable

import pytest


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
