"""For the engines' tests: whether a declaration's known findings cover a test id, as the plugin decides it
(contract/findings.py: `KnownFinding.in_scope` on the test's function name and parameters)."""

from __future__ import annotations

from pytest_kvcompile.contract.findings import ENGINE_PARAM, MODEL_PARAM, PROMPT_PARAM
from pytest_kvcompile.models import zoo


def covers(findings, engine: str, test_id: str) -> bool:
    """`test_id` is ``check[ENGINE-MODEL]`` or ``check[ENGINE-MODEL-PROMPT]`` (the suites' ids)."""
    check, _, rest = test_id.partition("[")
    rest = rest.removesuffix("]").removeprefix(f"{engine}-")
    model = max((m for m in zoo.ZOO if rest == m or rest.startswith(f"{m}-")), key=len)
    params = {ENGINE_PARAM: engine, MODEL_PARAM: model}
    if rest != model:
        params[PROMPT_PARAM] = rest[len(model) + 1:]
    return any(f.in_scope(test_id, check, params) for f in findings)
