"""The plugin's command line: options and help, engine resolution in all three forms,
usage errors that name the fix, and the entry point switch."""

import re
import textwrap
from pathlib import Path

import pytest

from conftest import run_pytest, run_suites

ENGINE_TEST = """
def test_engine(kv_engine):
    assert kv_engine.name
"""


def test_help_shows_the_kvcompile_group_and_ini_keys(kvtester):
    result = run_pytest(kvtester, "--help")
    result.stdout.fnmatch_lines([
        "KV-cache + compile engine conformance (pytest-kvcompile):",
        "  --kv-engine=NAME*",
        "  --kv-model=PATH*",
        "  --kv-list-engines*",
        "  kv_engines (linelist):*",
        "  kv_tie_tolerance (string):*",
    ])


def test_plugin_can_be_disabled(kvtester):
    result = run_pytest(kvtester, "-p", "no:kvcompile", "--kv-engine=hf-eager")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --kv-engine=hf-eager*"])


def test_list_engines_prints_builtins_with_declarations(kvtester):
    result = run_pytest(kvtester, "--kv-list-engines")
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "hf-eager *strategy=exact capabilities=*compiled=no*built-in: pytest_kvcompile.engines.hf:HFEager*",
        "hf-static-compile *compiled=yes*",
        "ref-compiled-dynamic *",
    ])
    assert "collected" not in result.stdout.str()


def test_unknown_engine_is_a_usage_error_listing_engines(kvtester):
    result = run_pytest(kvtester, "--kv-engine=nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: unknown engine 'nope'. Available engines: ctranslate2, executorch, hf-assisted, "
        "hf-continuous-batching, hf-continuous-batching-prefix-cache, hf-dynamic-compile, hf-eager, hf-export, "
        "*kvpress-knorm, *litgpt, *llama-cpp, *llama-cpp-prompt-cache, *mistralrs, *onnxruntime, openvino, "
        "ref-chunked-prefill, ref-compiled-dynamic*vllm, vllm-compile, vllm-ngram, vllm-prefix-cache, vllm-server. "
        "Give a built-in name*"
        "import path 'package.module:attr'*--kv-list-engines*",
    ])


def test_import_path_engine_runs_with_its_name_in_the_test_id(kvtester):
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-zoo=llama", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_engine?kv_test_engines:Greedy-llama? PASSED*"])


def test_engine_from_an_entry_point_and_ini(kvtester, monkeypatch):
    dist = kvtester.path / "site" / "my_engines-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-engines\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest_kvcompile.engines]\nmine = kv_test_engines:greedy_function\n")
    monkeypatch.setenv("PYTHONPATH", str(kvtester.path / "site"), prepend=":")
    kvtester.makeini("[pytest]\nkv_engines =\n    mine\n    kv_test_engines:Unbatched\nkv_zoo = llama\n")
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_engine?mine-llama? PASSED*",
                                 "*test_engine?kv_test_engines:Unbatched-llama? PASSED*"])
    listing = run_pytest(kvtester, "--kv-list-engines")
    listing.stdout.fnmatch_lines(["mine *strategy=exact capabilities=- "
                                  "*entry point of my-engines: kv_test_engines:greedy_function*"])


def test_engine_import_error_shows_the_engines_traceback(kvtester):
    kvtester.makepyfile(broken_engine=textwrap.dedent("""
        import helper_that_is_not_installed

        class Engine:
            pass
    """))
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-engine=broken_engine:Engine", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: engine 'broken_engine:Engine': importing module 'broken_engine' failed "
        "(ModuleNotFoundError: No module named 'helper_that_is_not_installed').",
        "The engine's traceback:",
        "*broken_engine.py*line 1*",
        "*import helper_that_is_not_installed*",
        "Hint: the package 'helper_that_is_not_installed' is not installed in this environment.",
    ])
    assert "registry.py" not in result.stderr.str()


def test_missing_engine_package_is_a_usage_error_naming_the_install(kvtester):
    kvtester.makepyfile(needs_pkg=textwrap.dedent("""
        from pytest_kvcompile import Declaration

        class Engine:
            kv_declaration = Declaration(requires=(("kv_pkg_that_is_not_installed", "kv-pkg==1.2"),))
    """))
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-engine=needs_pkg:Engine", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: engine 'needs_pkg:Engine' needs 'kv_pkg_that_is_not_installed', not installed in this environment (*",
        "Install it: python -m pip install 'kv-pkg==1.2'",
        "or check it in a virtual environment of its own: kvcompile check-engine needs_pkg:Engine",
    ])
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize("name, message", [
    ("kv_test_engines:Missing",
     "*engine 'kv_test_engines:Missing': module 'kv_test_engines' has no attribute 'Missing'*"),
    ("kv_test_engines:__doc__",
     "*engine 'kv_test_engines:__doc__': 'kv_test_engines:__doc__' is a str, not a factory*"),
    ("kv_test_engines:BadDeclaration", "*kv_declaration must be a pytest_kvcompile.Declaration, got dict*"),
])
def test_bad_engine_targets_are_usage_errors(kvtester, name, message):
    result = run_pytest(kvtester, f"--kv-engine={name}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize("option, message", [
    ("--kv-dtype=float64", "*--kv-dtype='float64': choose one of float32, bfloat16, float16*"),
    ("--kv-max-new-tokens=0", "*--kv-max-new-tokens='0': give a whole number >= 1*"),
    ("--kv-tie-tolerance=-1", "*--kv-tie-tolerance='-1': give 'auto' or a logit gap >= 0*"),
    ("--kv-device=gpu0", "*--kv-device='gpu0' is not a torch device*"),
    ("--kv-oracle-device=gpu0", "*--kv-oracle-device='gpu0' is not a torch device*"),
    ("--kv-zoo=llama,gpt9", "*--kv-zoo: unknown zoo model(s) ?'gpt9'?; choose from llama*"),
    ("--kv-zoo-head-dim=15", "*--kv-zoo-head-dim='15': give an even whole number >= 2 (RoPE rotates pairs), e.g. 32*"),
    ("--kv-model=/nonexistent/dir", "*--kv-model=/nonexistent/dir: not a local Hugging Face checkpoint directory*"),
    ("--kv-profile=quick", "*--kv-profile='quick': choose one of full, ci, smoke*"),
])
def test_bad_option_values_are_usage_errors(kvtester, option, message):
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:Greedy", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([message])


def test_zoo_head_dim_builds_the_zoo_with_larger_heads(kvtester):
    kvtester.makepyfile("""
        def test_engine(kv_engine):
            config = kv_engine.spec.config
            assert [config.per_layer_config[i].head_dim for i in range(4)] == [32] * 4, config
    """)
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-zoo=gemma4-kvshared",
                                           "--kv-zoo-head-dim=32", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_no_engine_is_a_usage_error_naming_how_to_choose_one(kvtester):
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-zoo=llama")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no engine selected: pass --kv-engine=NAME (or the ini key kv_engines); pytest "
                                 "--kv-list-engines lists the engines (1 collected test(s) need one)*"])


@pytest.mark.full  # the no-engine usage error again, under xdist
def test_no_engine_under_xdist_errors_each_engine_test(kvtester):
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-zoo=llama", "-n", "2")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*no engine selected: pass --kv-engine=NAME*"])


def test_two_engines_parametrize_every_engine_test(kvtester):
    kvtester.makepyfile(ENGINE_TEST)
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:Greedy",
                                           "--kv-engine=kv_test_engines:Unbatched",
                                           "--kv-zoo=llama,mistral-sw", "--co", "-q")
    ids = sorted(line.split("::")[-1] for line in result.stdout.lines if "::test_engine[" in line)
    assert ids == [f"test_engine[kv_test_engines:{engine}-{model}]" for engine in ("Greedy", "Unbatched")
                   for model in ("llama", "mistral-sw")], result.stdout.str()  # in pytest's order (9.2 reorders)


def test_strict_markers_clean_and_bad_kv_requires_rejected(kvtester):
    kvtester.makepyfile("""
        import pytest

        @pytest.mark.kv_requires("batching")
        def test_ok(kv_engine):
            pass

        @pytest.mark.kv_requires("teleport")
        def test_bad(kv_engine):
            pass
    """)
    result = run_pytest(kvtester, "--strict-markers", "--kv-engine=kv_test_engines:Greedy", "--kv-zoo=llama",
                                           "-n", "2")
    assert result.ret != pytest.ExitCode.OK  # a collection error (2 serial, 1 under xdist)
    result.stdout.fnmatch_lines([
        "*test_bad*: @pytest.mark.kv_requires('teleport'): give one or more capability names as "
        "positional arguments: batching, scoring, kv_cache_bytes, compiled",
    ])


def test_kv_model_adds_a_local_checkpoint(kvtester, zoo_cache):
    from pytest_kvcompile.models import zoo

    local = zoo.checkpoint("llama", zoo_cache / "zoo")
    kvtester.makepyfile("""
        def test_model(kv_model, kv_engine):
            assert kv_model.path.name == kv_model.name and kv_model.config.vocab_size == 256
    """)
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-zoo=none",
                                           f"--kv-model={local}", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*test_model?kv_test_engines:Greedy-{local.name}? PASSED*"])


@pytest.mark.full  # xdist's grouping
def test_xdist_runs_each_engine_and_model_in_one_worker(kvtester):
    """Under --dist load the plugin's xdist scheduler gives each engine x model to one worker (run/grouping.py): an
    engine object is built, compiled and called in one worker, as in a serial run."""
    result = run_suites(kvtester, "--kv-engine=hf-eager", "--kv-zoo=llama,gpt2-abspos", "-n", "2", "-v",
                        "-k", "token_identity or stale_state")
    assert result.ret == 0, result.stdout.str()[-3000:]
    workers: dict[str, set[str]] = {}
    for line in result.stdout.lines:
        found = re.search(r"\[(gw\d)\] .*(?:PASSED|SKIPPED).*\[hf-eager-(llama|gpt2-abspos)", line)
        if found:
            workers.setdefault(found[2], set()).add(found[1])
    assert set(workers) == {"llama", "gpt2-abspos"} and all(len(w) == 1 for w in workers.values()), workers


def test_scope_of_reads_engine_and_model_from_the_node_id():
    from pytest_kvcompile.run.grouping import scope_of

    engines, models = ["hf-static", "hf-static-compile", "mod:Engine"], ["gemma4", "gemma4-kvshared", "llama"]
    assert scope_of("s/t.py::test_x[hf-static-compile-gemma4-kvshared-len1]", engines, models) == \
        "kv:hf-static-compile:gemma4-kvshared"
    assert scope_of("s/t.py::test_x[hf-static-gemma4]", engines, models) == "kv:hf-static:gemma4"
    assert scope_of("s/t.py::test_x[mod:Engine-llama-decode]", engines, models) == "kv:mod:Engine:llama"
    assert scope_of("s/t.py::test_x[mod:Engine]", engines, models) == "kv:mod:Engine:"
    assert scope_of("tests/test_y.py::test_plain", engines, models) == "tests/test_y.py::test_plain"
    assert scope_of("tests/test_y.py::test_p[other-llama]", engines, models) == "tests/test_y.py::test_p[other-llama]"


def test_one_gpu_per_xdist_worker_where_there_are_several(monkeypatch):
    """Issue 54: -n N with --kv-device=cuda on N GPUs puts worker gwK on cuda:K (its engines and oracle), simulated here
    by the device count; an explicit index, one GPU, or no xdist keep the device as given."""
    import torch

    from pytest_kvcompile.config import options
    from pytest_kvcompile.run import session as sessions

    assert [options.worker_device("cuda", f"gw{k}", 4) for k in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert options.worker_device("cuda", "gw1", 1) == "cuda"
    assert options.worker_device("cuda:2", "gw1", 4) == "cuda:2" and options.worker_device("cuda", None, 4) == "cuda"
    assert options.worker_device("cpu", "gw3", 4) == "cpu" and options.worker_device("cuda", "master", 4) == "cuda"
    monkeypatch.setattr(sessions, "check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    settings = options.Settings(**{**{f: None for f in options.Settings.__dataclass_fields__}, "device": "cuda"})
    said = []
    session = sessions.Session(settings, {}, None, None, said.append)
    assert session.settings.device == "cuda:1" and said == [
        "xdist worker gw3: engines and oracle on cuda:1 (one GPU per worker, 2 GPUs)"]


def test_a_shared_engine_not_fitting_twice_is_released_before_a_fresh_one_is_built(monkeypatch):
    """Issue 54: a check building a fresh engine object beside the shared one (test_identical_calls_compile_nothing)
    first releases the shared one where a second copy of what it holds would not fit in half the free memory; it is
    kept where it fits (built anew by the next test otherwise)."""
    import types

    import torch

    from pytest_kvcompile.config import options
    from pytest_kvcompile.run import session as sessions
    from pytest_kvcompile.run.harness import EngineUnderTest

    settings = options.Settings(**{**{f: None for f in options.Settings.__dataclass_fields__}, "device": "cpu"})
    said = []
    session = sessions.Session(settings, {}, None, None, said.append)
    shared = EngineUnderTest(None, types.SimpleNamespace(device="cpu"), torch.nn.Linear(1024, 1024, bias=False), 4,
                             0.0, None)  # 4 MiB of weights
    session._built[("e", "m")] = shared
    monkeypatch.setattr(sessions, "available_bytes", lambda device: 8 * 2**20)  # two copies: exactly half
    session._make_room("e", "m")
    assert session._built[("e", "m")] is shared and said == []
    monkeypatch.setattr(sessions, "available_bytes", lambda device: 8 * 2**20 - 1)
    session._make_room("e", "m")
    assert ("e", "m") not in session._built and len(said) == 1, said
    assert said[0].startswith("e / m: its shared object released for a fresh one (4") and said[0].endswith(
        "free); the next test builds it anew"), said


def test_a_profile_narrows_the_run_and_names_what_it_left_out(kvtester):
    """Issue 54: --kv-profile=smoke runs the token checks on three prompts; the summary says what it left out. In
    bfloat16 its calibration stops where its checks' sequences end (the long prompts left out), and says so (a store of
    its own: the shared one may hold the whole calibration, which would serve it instead)."""
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-profile=smoke", "-v",
                        "--kv-dtype=bfloat16", f"--kv-record-references={kvtester.path / 'store'}",
                        "-k", "token_identity or long_generation or determinism")
    passed = sorted(re.findall(r"test_(\w+)\[kv_test_engines:Greedy-llama(?:-(\w+))?\] PASSED", result.stdout.str()))
    assert passed == [("token_identity", "len1"), ("token_identity", "long48"), ("token_identity", "short7"),
                      ("token_identity_batched", "")], result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([
        "*kvcompile: profile 'smoke' (a smaller run than 'full')*",
        "the profile 'smoke' ran token identity, stale state, *",
        "checks left out: every other one",
        "prompts left out: all but len1, short7, long48 (batches as they are)",
        "* test(s) deselected; the complete run: --kv-profile=full (the default)"])
    result.stdout.fnmatch_lines(["*kvcompile: peak memory*", "host: * GiB peak RSS in this process*"])
    result.stdout.fnmatch_lines(["*llama (bfloat16): tie tolerance * at up to 162 positions (as far as the run's "
                                 "checks attend: a sequence past that is not judged)*; calibration * s for * positions "
                                 "(measured this run; kept in the store per model, dtype and code version)"])


def test_a_run_of_bounded_checks_calibrates_as_far_as_its_selection_attends():
    """A run narrowed by -k or node ids to checks of bounded length (smoke's) calibrates as far as the prompts it
    selected attend; one selected check past them (a long generation), or the selection unknown, every length."""
    from pytest_kvcompile.config.profiles import PROFILES, Selection

    full, prompts, batch = PROFILES["full"], {"len1": 1, "short7": 7, "long48": 48, "long250": 250}, [5, 17]
    token = Selection(frozenset({"test_token_identity", "test_token_identity_batched"}), frozenset(prompts))
    assert token.bounded and full.attends(prompts, batch, 32, token) == 250 + 32
    short = Selection(frozenset({"test_token_identity"}), frozenset({"len1", "short7"}))
    assert full.attends(prompts, batch, 32, short) == 64 + 32  # the stale-state prompts (up to 64 tokens): the longest
    assert full.attends(prompts, [5, 90], 32, short) == 90 + 32  # the model's batch, whatever was selected
    assert full.attends({"len1": 1, "short7": 7, "long48": 48}, batch, 32, short) == 48 + 32
    longer = Selection(token.checks | {"test_long_generation"}, token.prompts)
    assert not longer.bounded and full.attends(prompts, batch, 32, longer) is None
    assert full.attends(prompts, batch, 32) is None and not Selection(frozenset(), frozenset()).bounded
    assert PROFILES["smoke"].attends(prompts, batch, 32, longer) == 64 + 32  # a profile's own bound stays


def test_a_run_narrowed_by_k_to_bounded_checks_calibrates_no_farther(kvtester):
    """The plugin's side of the rule above: -k leaves token identity on two short prompts (no profile), and the
    bfloat16 calibration stops where their sequences end and says so (a store of its own, as above)."""
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-dtype=bfloat16",
                        f"--kv-record-references={kvtester.path / 'store'}",
                        "-k", "token_identity and not batched and (len1 or short7)")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*llama (bfloat16): tie tolerance * at up to 162 positions (as far as the run's "
                                 "checks attend: a sequence past that is not judged)*"])


def test_every_check_a_profile_names_is_a_suite_check():
    from pytest_kvcompile.config.profiles import PROFILES

    suites = Path(__file__).resolve().parents[1] / "suites"
    checks = set(re.findall(r"^def (test_\w+)", "\n".join(p.read_text() for p in suites.glob("test_*.py")), re.M))
    for profile in PROFILES.values():
        named = set(profile.leaves_out) | set(profile.keeps or ())
        assert named <= checks, f"profile '{profile.name}' names {sorted(named - checks)}, which no suite defines"
