"""The transformers oracle judges an engine's tokens in one forward (issue 54: oracles/hf.py `teacher_forced`), the
same function as its greedy loop's steps: on every zoo layout the rows agree to rounding, and a run's store hands out
references that decode the greedy loop only where something reads it (oracles/store.py)."""

import threading

import pytest
import torch
from transformers import AutoConfig

from pytest_kvcompile.contract.engine import ModelSpec, Strategy
from pytest_kvcompile.models import zoo
from pytest_kvcompile.oracles.hf import HFEagerOracle
from pytest_kvcompile.oracles.reference import LazyReference
from pytest_kvcompile.oracles.store import StoredOracle


@pytest.mark.parametrize("name", ["llama", "mistral-sw", "gemma4-kvshared", "gpt2-abspos"])
def test_one_forward_equals_the_greedy_loop(name, zoo_cache):
    path = zoo.checkpoint(name, zoo_cache)
    oracle = HFEagerOracle(ModelSpec(name, path, AutoConfig.from_pretrained(path)))
    prompt = [(i * 37 + 11) % 256 for i in range(19)]  # decoding crosses the sliding window
    greedy = oracle.reference(prompt, 16)
    forced = oracle.teacher_forced(prompt, greedy.tokens)
    assert forced.shape == greedy.logits.shape
    torch.testing.assert_close(forced, greedy.logits, atol=1e-4, rtol=1e-4)
    assert tuple(forced.argmax(-1).tolist()) == greedy.tokens


def test_the_store_judges_without_the_greedy_loop(zoo_cache, tmp_path, monkeypatch):
    path = zoo.checkpoint("llama", zoo_cache)
    spec = ModelSpec("llama", path, AutoConfig.from_pretrained(path))
    want = HFEagerOracle(spec).reference([3, 1, 4, 1, 5], 8).tokens
    oracle = HFEagerOracle(spec)
    stored = StoredOracle(oracle, Strategy(), spec, 1e-3, tmp_path)
    loops = []
    monkeypatch.setattr(oracle, "_run", lambda *args: loops.append(args) or HFEagerOracle._run(oracle, *args))
    ref = stored.reference([3, 1, 4, 1, 5], 8)
    assert isinstance(ref, LazyReference) and stored.lazy
    rows = ref.given(want, 1e-3)
    assert tuple(rows.argmax(-1).tolist()) == want and loops == []  # judged: one forward, self-checked, no loop
    assert stored._checked == {((3, 1, 4, 1, 5), want)}  # the float64 self-check ran along the engine's tokens
    assert ref.tokens == want and len(loops) == 1  # read: decoded once, then memoized


def test_a_run_finding_its_judgments_in_the_store_loads_no_oracle_model(zoo_cache, tmp_path):
    """Issue 54: the oracle and its float64 self-check load their models on a miss only, so a later run (a pull
    request's, over a store a nightly job recorded) judging the same tokens spends nothing on the oracle."""
    path = zoo.checkpoint("llama", zoo_cache)
    spec = ModelSpec("llama", path, AutoConfig.from_pretrained(path))
    prompt = (3, 1, 4, 1, 5)
    first = HFEagerOracle(spec)
    tokens = first.reference(prompt, 8).tokens
    StoredOracle(first, Strategy(), spec, 1e-3, tmp_path).reference(prompt, 8).given(tokens, 1e-3)
    later = HFEagerOracle(spec)
    stored = StoredOracle(later, Strategy(), spec, 1e-3, tmp_path)
    rows = stored.reference(prompt, 8).given(tokens, 1e-3)
    assert tuple(rows.argmax(-1).tolist()) == tokens and stored._checked  # judged and self-checked...
    assert "model" not in vars(later) and "model" not in vars(stored._independent[0])  # ...from the store alone


def test_a_calibration_another_process_is_computing_is_waited_for_not_computed_twice(zoo_cache, tmp_path):
    """Two xdist workers (or two runs) on one store needing the same 16-bit calibration: the second waits for the
    first's claim (store.DiskMemo.claimed, a lock file beside the entry) and loads its result. Two oracles in two
    threads here: each claim is its own open file, so they exclude each other as two processes' would."""
    path = zoo.checkpoint("llama", zoo_cache)
    spec = ModelSpec("llama", path, AutoConfig.from_pretrained(path))
    first, second = (StoredOracle(HFEagerOracle(spec), Strategy(), spec, 1e-3, tmp_path) for _ in range(2))
    key, computed, started, release = ("noise", "test"), [], threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)
        computed.append("first")
        return {"scale": 1.0}

    thread = threading.Thread(target=lambda: first._cached(key, slow, claim=True))
    thread.start()
    assert started.wait(10)
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(
        second._cached(key, lambda: computed.append("second") or {"scale": 2.0}, claim=True)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not answers  # waiting on the first's claim, not computing
    release.set()
    thread.join(10)
    waiter.join(10)
    assert computed == ["first"] and answers == [{"scale": 1.0}]
    # an unclaimed key (a reference: cheap, computed where it is missing) does not wait
    assert second._cached(("other",), lambda: 3) == 3
