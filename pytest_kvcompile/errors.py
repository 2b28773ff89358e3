"""Errors the plugin raises on bad input. Each message names the fix."""

import pytest


class EngineResolutionError(pytest.UsageError):
    """An engine NAME given to --kv-engine cannot be resolved or imported."""


class MalformedOutput(Exception):
    """An engine returned something that breaks the engine contract."""
