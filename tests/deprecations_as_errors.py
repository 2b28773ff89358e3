"""A pytest plugin for CI's ``newest-transformers`` job (issue 40): every deprecation a run meets is an error.

Load it with ``-p deprecations_as_errors`` (``tests/`` on ``PYTHONPATH``; xdist workers load it too). It

- turns every ``FutureWarning`` and ``DeprecationWarning`` into an error (transformers warns with ``FutureWarning``,
  torch, pytest-benchmark, hypothesis and xdist with either), the project's own filters (pyproject.toml) kept below;
- re-issues transformers' *logged* deprecations (``logger.warning_once("... deprecated ...")``, e.g. reading
  ``output.past_key_values`` on 5.24) as ``FutureWarning``, so they raise where they are logged too. Run it with
  ``TRANSFORMERS_VERBOSITY=warning``: the repository's conftest.py silences transformers' logger otherwise.

A deprecation raised inside an engine call fails that check (the harness contains the exception and names it), one
raised in the oracle or a fixture fails the test; the job also fails on any warnings summary at all (.ci/run).
"""

from __future__ import annotations

import logging
import warnings

import pytest

#: Deprecations raised inside a third-party library by its own code, not by a call of ours, left as they are (each
#: with where it comes from). Empty is the aim; anything added here needs its reason.
THIRD_PARTY_INTERNAL: tuple[str, ...] = (
    # torch's own torch.utils.mkldnn, imported by inductor, decorates with torch.jit.script_method
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
)


class LoggedDeprecation(logging.Handler):
    """Re-issues a logged record that says "deprecated" as a ``FutureWarning`` from where it was logged."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecated" in message.lower():
            warnings.warn(f"{record.name} logged: {message}", FutureWarning, stacklevel=2)


_HANDLER = LoggedDeprecation(logging.WARNING)


def pytest_configure(config: pytest.Config) -> None:
    # pytest applies the ini lines in order, a later one taking precedence: errors first, then the named exceptions
    for line in ("error::FutureWarning", "error::DeprecationWarning", *THIRD_PARTY_INTERNAL):
        config.addinivalue_line("filterwarnings", line)
    logging.getLogger("transformers").addHandler(_HANDLER)


def pytest_unconfigure(config: pytest.Config) -> None:
    logging.getLogger("transformers").removeHandler(_HANDLER)
