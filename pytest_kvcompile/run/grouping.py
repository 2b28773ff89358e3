"""Under pytest-xdist, one engine x model per worker: each engine object is built and compiled in one worker and
serves the same calls in the same order as in a serial run, so verdicts do not depend on ``-n``.

How: when the run checks engines and xdist distributes with its default ``--dist load`` (not one the user
passed), the plugin answers xdist's ``pytest_xdist_make_scheduler`` hook with `EngineModelScheduling`: xdist's
scope scheduler with the scope of a test read from its node id, ``kv:<engine>:<model>`` for engine tests
(every other test is its own scope, as under ``load``). Node ids are not rewritten: pytest 9.2 no longer lets
a plugin change them (xdist 3.8's own ``loadgroup`` suffix is silently lost there), and the hook is public.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import pytest


def scope_of(nodeid: str, engines: Iterable[str], models: Iterable[str]) -> str:
    """``kv:<engine>:<model>`` for a test parametrized by a run's engine and model (its id starts with
    ``[<engine>-<model>``), else the node id itself. The longest names match first ('hf-static-compile' before
    'hf-static'); an engine test without a model is ``kv:<engine>:``."""
    params = re.search(r"\[(.*)\]$", nodeid)
    if params is None:
        return nodeid
    ident = params.group(1)
    for engine in sorted(engines, key=len, reverse=True):
        if ident == engine or ident.startswith(engine + "-"):
            rest = ident[len(engine) + 1:]
            model = next((m for m in sorted(models, key=len, reverse=True)
                          if rest == m or rest.startswith(m + "-")), "")
            return f"kv:{engine}:{model}"
    return nodeid


def wants_grouping(config: pytest.Config, engines: Iterable[str]) -> bool:
    """The controller of an xdist run that checks engines under ``--dist load`` the user did not choose."""
    explicit = any(a == "--dist" or a.startswith("--dist=") or a == "-d" for a in config.invocation_params.args)
    return bool(list(engines)) and config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput") \
        and getattr(config.option, "dist", "no") == "load" and not explicit


class SchedulerHook:
    """The plugin object answering ``pytest_xdist_make_scheduler`` (registered on the controller only)."""

    def __init__(self, engines: Iterable[str], models: Iterable[str]) -> None:
        self.engines, self.models = list(engines), list(models)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadScopeScheduling

        engines, models = self.engines, self.models

        class EngineModelScheduling(LoadScopeScheduling):
            """xdist's scope scheduling, one scope per engine x model (`scope_of`)."""

            def _split_scope(self, nodeid: str) -> str:
                return scope_of(nodeid, engines, models)

        return EngineModelScheduling(config, log)
