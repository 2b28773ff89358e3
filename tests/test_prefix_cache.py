"""Issue 41: prefix caches and long generations. ref-paged-prefix and a correct bounded (growing) cache pass the prefix
suite, the long generations and the memory contract; each twin of tests/kv_test_engines_prefix.py fails the check
written for its bug, with a message naming it."""

import pytest

from conftest import run_suites
from pytest_kvcompile import Declaration, PrefixCache

CHECKS = "prefix_cache or long_generation or no_memory_growth"
PREFIX = "kv_test_engines_prefix"


def test_paged_prefix_and_a_growing_bounded_cache_pass(kvtester):
    """ref-paged-prefix, a pool growing to its capacity, and one keeping prompt blocks only (issue 59: the memory
    check counts the prompt positions it offered, not the generated ones)."""
    result = run_suites(kvtester, "--kv-engine=ref-paged-prefix", f"--kv-engine={PREFIX}:GrowingPrefixCache",
                        "--kv-compile-backend=aot_eager", "-k", CHECKS)
    result.assert_outcomes(passed=18)
    prompts_only = run_suites(kvtester, f"--kv-engine={PREFIX}:PromptOnlyPrefixCache", "-k", "no_memory_growth",
                              "-rA")
    prompts_only.assert_outcomes(passed=1)


#: twin -> (the check that must fail it, lines its failure must print)
TWINS = {
    "StaleFullHitLogits": ("test_full_hit", ["*prompt 'hit16' (length 16), call 8 of 21 *, after prompts "
                                             "[[]hit15, hit15, hit16+tail[]]: full-hit check*"]),
    "UnchainedHashes": ("test_later_block_after_different_prefix", ["*prompt 's16+tail' (length 24)*"]),
    "EvictsInUse": ("test_eviction", ["*prompt 'flood0+240' (length 480)*eviction check, a cache of 2048 positions "
                                      "(declared)*"]),
    "NoCopyOnWrite": ("test_shared_prefixes", ["*prompt 'shared1+a' (length 9), call 4 of 29 *, after prompts "
                                               "[[]shared1+a, shared1+b, shared1+b[]]: shared-prefix check*"]),
    "DecodeBufferWraps": ("test_long_generation", ["*prompt 'long-gen7' (length 7), long generation: 505 new "
                                                   "tokens, to position 512: step 9[6-9] of 505"]),
    "GrowingUndeclared": ("test_no_memory_growth", [
        "*memory grows over 3 repeated calls*", "*kv_cache_bytes(): * after 1 warmup call(s), then *",
        "*a prefix cache kept across calls on purpose declares *(prefix_cache=PrefixCache(capacity_tokens=N))"]),
    "CapacityExceeded": ("test_no_memory_growth", [  # offered 2 x 256 prompt positions: it grows to 1,024
        "*grows past its declared PrefixCache(capacity_tokens=256, block_size=16, capacity_bytes=None) over 11 calls*",
        "*live tensor bytes: 524,288 B (512.0 KiB) at its peak, over the 262,912 B (256.8 KiB) it may hold (1.5 x the "
        "K/V of its declared capacity_tokens=256 *"]),
}


def test_each_twin_fails_the_check_for_its_bug(kvtester):
    select = " or ".join(f"({check} and {twin})" for twin, (check, _) in TWINS.items())
    result = run_suites(kvtester, *(f"--kv-engine={PREFIX}:{twin}" for twin in TWINS), "-k", select)
    # -k matches prefixes too: DecodeBufferWraps also fails test_long_generation_batched, NoCopyOnWrite passes
    # test_shared_prefixes_batched (a batch shares blocks within the call: nothing is written into a registered one)
    result.assert_outcomes(failed=len(TWINS) + 1, passed=1)
    for twin, (check, says) in TWINS.items():
        result.stdout.fnmatch_lines([f"FAILED *{check}[[]{PREFIX}:{twin}-llama[]]*"])
        result.stdout.fnmatch_lines(says)


@pytest.mark.parametrize(("changes", "says"), [
    ({"capacity_tokens": 0}, "PrefixCache(capacity_tokens=0): capacity_tokens must be an int >= 1, e.g."),
    ({"capacity_tokens": 64, "block_size": "16"}, "PrefixCache(block_size='16'): block_size must be an int >= 1 or "
                                                  "None"),
])
def test_a_bad_prefix_cache_declaration_names_the_fix(changes, says):
    with pytest.raises(ValueError, match=f"^{says.replace('(', '[(]').replace(')', '[)]')}"):
        PrefixCache(**changes)


def test_prefix_cache_must_be_a_prefix_cache():
    with pytest.raises(ValueError, match="write prefix_cache=PrefixCache"):
        Declaration(prefix_cache=2048)
