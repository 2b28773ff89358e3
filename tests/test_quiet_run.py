"""A quiet run (issue 31): the plugin, its suites and its reference engines put no warning into a user's summary,
and the project's own warning filters (pyproject.toml, `filterwarnings`) turn pytest's deprecations into errors, so
a fixture or hook written the deprecated way fails CI before a pytest release breaks every user."""

import re
from pathlib import Path

import _pytest.deprecated
import pytest

from conftest import SUITES_DIR

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def project_filterwarnings() -> list[str]:
    """The `filterwarnings` lines of the project's pytest configuration (pyproject.toml)."""
    text = PYPROJECT.read_text()
    block = re.search(r"^filterwarnings = \[(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml: [tool.pytest.ini_options] has no filterwarnings list"
    return re.findall(r'"([^"]+)"', block.group(1))


def test_the_project_turns_pytest_and_own_deprecations_into_errors():
    lines = project_filterwarnings()
    assert "error::pytest.PytestDeprecationWarning" in lines, lines
    for package in ("pytest_kvcompile", "reference_impls"):
        assert f"error::DeprecationWarning:{package}" in lines, lines


@pytest.mark.skipif(not hasattr(_pytest.deprecated, "CLASS_FIXTURE_INSTANCE_METHOD"),
                    reason="this pytest does not deprecate session fixtures defined as instance methods (pytest < 9.1)")
def test_twin_a_session_fixture_on_a_plugin_instance_fails_under_the_project_filters(pytester):
    """The way plugin.py defined kv_session before issue 31: PytestRemovedIn10Warning, an error under our filters."""
    pytester.makeini("[pytest]\nfilterwarnings =\n" + "".join(f"    {line}\n" for line in project_filterwarnings()))
    pytester.makeconftest("""
        import pytest

        class Wiring:
            @pytest.fixture(scope="session")
            def wiring_session(self):
                return 1

        def pytest_configure(config):
            config.pluginmanager.register(Wiring(), "wiring")
    """)
    pytester.makepyfile("def test_uses_it(wiring_session):\n    assert wiring_session == 1\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*PytestRemovedIn10Warning*Session-scoped fixtures defined as instance methods*"])


@pytest.mark.full  # the README's main job (CI's newest-pytest job runs it too)
def test_the_main_job_leaves_no_warnings_summary(kvtester):
    """The README's main job in small (-n 2, pytest-benchmark on, inductor): no 'warnings summary' at all."""
    result = kvtester.runpytest_subprocess(
        str(SUITES_DIR), "-p", "no:cacheprovider", "--rootdir", str(kvtester.path), "--kv-zoo=llama", "-n", "2",
        "--kv-engine=ref-compiled-dynamic", "--kv-engine=hf-eager", "-k", "latency or determinism or recompiles",
    )
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.no_fnmatch_line("*warnings summary*")
