"""Issue 40: the plugin calls transformers with the spelling the installed release expects, and CI's
newest-transformers job (``-p deprecations_as_errors``) fails a call with a deprecated one."""

import pytest

from conftest import run_suites
from pytest_kvcompile.models.checkpoints import cache_keyword, transformers_version

NEW_CACHE_KEYWORD = transformers_version() >= (5, 24)


def test_the_cache_keyword_follows_the_installed_release():
    assert cache_keyword() == ("cache" if NEW_CACHE_KEYWORD else "past_key_values")


TWINS = {
    "OldCacheKeyword": "*FutureWarning*`past_key_values` is deprecated*Use `cache` instead*",
    "OldCacheField": "*FutureWarning*transformers*logged*`past_key_values`/`cache_params` are deprecated*",
}
CHECK = ("-k", "test_token_identity and not batched")
deprecating = pytest.mark.skipif(not NEW_CACHE_KEYWORD, reason="transformers < 5.24 deprecates no spelling the twins "
                                                               "use")


@deprecating
def test_the_twins_are_correct_engines_apart_from_the_spelling(kvtester):
    result = run_suites(kvtester, *(f"--kv-engine=kv_test_engines_deprecated:{twin}" for twin in TWINS), *CHECK)
    assert result.ret == 0, result.stdout.str()[-3000:]


@deprecating
@pytest.mark.parametrize("twin", TWINS)
def test_twin_a_deprecated_spelling_fails_under_deprecations_as_errors(kvtester, monkeypatch, twin):
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")  # conftest.py silences transformers' logger otherwise
    result = run_suites(kvtester, "-p", "deprecations_as_errors", f"--kv-engine=kv_test_engines_deprecated:{twin}",
                        *CHECK)
    assert result.ret == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([TWINS[twin]])
