"""Per-process state of a run: settings, resolved engines, models, and the engines/oracles built so far
(shared by every test of the process). Built by the plugin on first use and handed to the fixtures
(``kv_session``); it imports torch and transformers, nothing else does before it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_kvcompile.config.options import (
    MAX_NEAR_TIE_RATE,
    MAX_NEAR_TIES,
    NO_ENGINE,
    ORACLE_DEVICE,
    RECORD_REFERENCES,
    REFERENCES,
    TIE_TOLERANCE,
    Settings,
    check_device,
    worker_device,
)
from pytest_kvcompile.config.profiles import PROFILES, Selection
from pytest_kvcompile.contract import engine_io
from pytest_kvcompile.contract.engine import (
    Lowered,
    ModelNotSupported,
    ModelSpec,
    Strategy,
    missing_capability,
    never_emitted,
)
from pytest_kvcompile.contract.registry import SERVER_SOURCE, EngineRef
from pytest_kvcompile.errors import NotApplicable, OracleUnavailable, Skipped, Unjudgeable, UsageError, fail
from pytest_kvcompile.latency.marker import Settings as LatencySettings
from pytest_kvcompile.memory.measure import available_bytes
from pytest_kvcompile.memory.units import format_bytes
from pytest_kvcompile.models import checkpoints as models
from pytest_kvcompile.models.checkpoints import ModelEntry
from pytest_kvcompile.models.prompts import Prompt, batch, prompt_set
from pytest_kvcompile.models.texts import has_tokenizer, text_prompts
from pytest_kvcompile.models.zoo import code_hash
from pytest_kvcompile.oracles import precision
from pytest_kvcompile.oracles.hf import NoOracle, exercising_lengths, oracle_for
from pytest_kvcompile.oracles.recorded import Recorded, References, content_digest
from pytest_kvcompile.oracles.store import LoweredView, StoredOracle, could_not_run
from pytest_kvcompile.recompiles.hooks import import_inductor_quietly
from pytest_kvcompile.recompiles.recorder import reset_dynamo
from pytest_kvcompile.run import host as hosts
from pytest_kvcompile.run.harness import EngineUnderTest
from pytest_kvcompile.verdicts.collect import Collector

SERVED_PROBE = (1, 7, 23)  # prompt lengths a user's server answers before anything is judged (Session._check_served)


@dataclass
class Session:
    settings: Settings
    engines: dict[str, EngineRef]
    collector: Collector
    latency: LatencySettings
    progress: Callable[[str], None] = lambda line: None  # one line per engine build and compile (the plugin's writer)
    on_call: Callable[[str, str, str, int], None] = lambda *beat: None  # before each engine build and call (reports)
    _models: dict[str, ModelEntry] | None = None
    _specs: dict[str, ModelSpec] = field(default_factory=dict)
    _built: dict[tuple[str, str], EngineUnderTest | NotApplicable | str] = field(default_factory=dict)
    _oracles: dict[tuple[str, str], Any] = field(default_factory=dict)
    _rules: dict[str | tuple[str, Lowered], Any] = field(default_factory=dict)  # model, or (model, lowered)
    #: engine NAME -> its oracle as resolved at start-up (oracles/engine.py: Choice); absent: hf
    oracles: dict[str, Any] = field(default_factory=dict)
    #: the engine checks this process collected for the run (the plugin, after -k and -m; None: not known)
    selection: Selection | None = None

    @property
    def models(self) -> dict[str, ModelEntry]:
        """Zoo and local models, read on first use (imports transformers only then)."""
        if self._models is None:
            self._models = models.collect(self.settings)
        return self._models

    def prompts(self, model: str) -> list[Prompt]:
        """The model's prompt set: the standard lengths, those that make the run's strategies act (eviction
        budgets), all within the model's position limit (prompts.py); where the checkpoint has a tokenizer, text a
        person would send beside them (texts.py)."""
        entry = self.models[model]
        extra: dict[str, int] = {}
        for ref in self.engines.values():
            extra.update(exercising_lengths(ref.declaration.strategy))
        limit = entry.max_positions - self.settings.max_new_tokens if entry.max_positions else None
        texts = text_prompts(entry.path, entry.vocab_size, limit) if not entry.own and has_tokenizer(entry.path) else []
        return texts + prompt_set(entry.vocab_size, entry.window, extra, limit)  # ids last: a map by length keeps them

    def spec(self, model: str) -> ModelSpec:
        entry = self.models[model]
        if entry.unavailable:
            raise NotApplicable(f"model '{model}' unavailable: {entry.unavailable}")
        if model not in self._specs:
            self._specs[model] = models.spec_for(entry, self.settings)
        return self._specs[model]

    def _harness_spec(self, model: str) -> ModelSpec:
        """The model's spec where the oracle and the equivalent computations run (--kv-oracle-device)."""
        spec = self.spec(model)
        device = self.settings.harness_device
        return spec if device == spec.device or not self.settings.oracle_device else dataclasses.replace(
            spec, device=device)

    def __post_init__(self) -> None:
        check_device(self.settings.device)
        if self.settings.oracle_device:
            check_device(self.settings.oracle_device, ORACLE_DEVICE)
        if self.settings.device == "cuda":  # one GPU per xdist worker where there are several (worker_device)
            import torch

            mine = worker_device("cuda", os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
            if mine != self.settings.device:
                self.settings = dataclasses.replace(self.settings, device=mine)
                self.progress(f"xdist worker {os.environ['PYTEST_XDIST_WORKER']}: engines and oracle on {mine} (one "
                              f"GPU per worker, {torch.cuda.device_count()} GPUs)")

    def engine(self, name: str, model: str) -> EngineUnderTest:
        """The engine built for the model, once per process (each time with --kv-fresh-engine); a failed build
        fails every test using it."""
        key = (name, model)
        if key in self._built and not self.settings.fresh_engine:
            built = self._built[key]
            if isinstance(built, NotApplicable):  # the factory said ModelNotSupported: it will say it again
                raise NotApplicable(built.msg)
            if isinstance(built, str):
                fail(built + " (see its first failure for the traceback)", pytrace=False)
            broken = built.broken or built.host.dead  # a call timed out, its process died, its server is gone
            if not broken:
                return built
            self.progress(f"{name} / {model}: building it anew ({broken.splitlines()[0]})")
            built.host.close()  # a managed server that hung is stopped now, not when the object is collected
        self._built[key] = f"engine '{name}' failed to build for model '{model}' in an earlier test"
        try:
            self._built[key] = self.fresh_engine(name, model)
        except NotApplicable as exc:  # remembered: an isolated engine would start a process per test to say it
            self._built[key] = exc
            raise
        except Skipped:
            del self._built[key]
            raise
        return self._built[key]

    def fresh_engine(self, name: str, model: str) -> EngineUnderTest:
        """A new engine object for the model, not shared with other tests (checks of what a first call leaves)."""
        if name is None:  # the "no-engine" parameter on an xdist worker (the controller raises the usage error)
            fail(NO_ENGINE, pytrace=False)
        ref, spec = self.engines[name], self.spec(model)
        missing = missing_capability(ref.declaration, spec)
        if missing:
            raise NotApplicable(f"engine '{name}' does not declare {missing}")
        excluded = never_emitted(ref.declaration.never_emits, spec.config)
        beyond = sorted(i for i in excluded if not 0 <= i < spec.vocab_size)
        if beyond:
            fail(f"engine '{name}' declares never_emits={ref.declaration.never_emits}: ids {beyond} are not in "
                 f"model '{model}''s vocabulary of {spec.vocab_size}", pytrace=False)
        if excluded:
            self.collector.add(name, model, excluded_ids=sorted(excluded))
        self._make_room(name, model)
        if ref.declaration.compiled:
            reset_dynamo()  # a fresh dynamo per compiled engine: no shared cache entries or recompile limit
            if self.settings.compile_backend == "inductor":
                import_inductor_quietly()  # before the engine's first compile imports it, warning about torch
        self.on_call(name, model, f"its factory {ref.target}(ModelSpec(name='{model}', ...))", 0)
        started = time.perf_counter()
        # where it runs: here, or a process of its own reporting what dynamo did there (run/host.py)
        host = hosts.build(ref, spec, self.settings.compile_backend, self.settings.call_timeout,
                           self.settings.isolated(name, ref.declaration.isolated, ref.source == "built-in"))
        seconds = time.perf_counter() - started
        compiled = f", {len(host.build_compiles)} compile(s)" if host.build_compiles else ""
        self.progress(f"{name} / {model}: built in {seconds:.1f} s{host.where}{compiled}")
        self.collector.add(name, model, builds=1, build_s=round(seconds, 3), versions=ref.versions())
        settings, rules = self.settings, self._engine_rules(model, ref.declaration.lowered())
        if rules.noise is not None:
            self.collector.add(name, model, noise=rules.noise.to_dict())
            stored = self._stored(self.engines[name].declaration.strategy, model, f"engine '{name}'")
            if not isinstance(stored, str) and stored.score_noise is not None:
                self.collector.add(name, model, eviction_noise=stored.score_noise.to_dict())
            if not isinstance(stored, str) and stored.lazy and not stored.unavailable:
                lowered = ref.declaration.lowered()
                judging = stored if lowered is None else stored.for_lowered(self._harness_spec(model), lowered)
                with contextlib.suppress(OracleUnavailable):  # named where a token check asks the oracle
                    if isinstance(judging, LoweredView):  # the router noise of what it computes lower
                        self.collector.add(name, model, router_noise=judging.noise.to_dict())
                    elif stored.routed:
                        self.collector.add(name, model, router_noise=stored.router_noise().to_dict())
        built = EngineUnderTest(
            ref, spec, host.engine, settings.max_new_tokens, rules.tie_tolerance, self.models[model].window,
            build_compiles=host.build_compiles, build_captures=host.build_captures, call_timeout=settings.call_timeout,
            max_near_ties=rules.max_near_ties, score_tolerance=rules.score_tolerance,
            cuda_grown=host.cuda_grown, progress=self.progress, on_call=self.on_call, excluded=tuple(sorted(excluded)),
            noise=rules.noise, host=host,
            spent=lambda seconds: self.collector.add(name, model, generate_s=round(seconds, 4)),
        )
        if ref.source == SERVER_SOURCE:
            self._check_served(built)
        return built

    def _make_room(self, name: str, model: str) -> None:
        """Before another object of an engine is built beside the shared one (a check of what a first call leaves):
        the shared one is released, and built anew by the next test using it, unless a second copy of what it holds
        fits in half the memory its device has free (issue 54: a 3B float32 checkpoint's engine is an 11.5 GiB copy;
        a 16-bit checkpoint loaded as stored is the file mapped, and a second object mapping it adds little)."""
        shared = self._built.get((name, model))
        if not isinstance(shared, EngineUnderTest) or shared.host.dead:
            return
        held, device = shared.host.held(), shared.spec.device
        free = available_bytes(device)
        if free is None or 2 * (held.weights + held.state) <= free:
            return
        del self._built[(name, model)]
        shared.host.close()
        shared = None  # this frame's reference too: the collection below frees its memory now
        gc.collect()
        if str(device).startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        size = format_bytes(held.weights + held.state)
        self.progress(f"{name} / {model}: its shared object released for a fresh one ({size} held, "
                      f"{format_bytes(free)} free); the next test builds it anew")

    def _check_served(self, built: EngineUnderTest) -> None:
        """A server the user runs must serve the run's checkpoint: the first token of its answers to probe prompts
        (SERVED_PROBE lengths, alone: prefill only) against the oracle's, up to a near tie. Fails (every test of the
        engine x model) with what it says it serves before anything is judged; a server computing the checkpoint wrongly
        later (decode, batching, caching) is left to the checks, which say where. Without an oracle the checks that
        need one skip anyway."""
        from pytest_kvcompile.models.prompts import of_length
        from pytest_kvcompile.oracles.token_match import token_verdict

        __tracebackhide__ = True
        name, model, engine = built.name, built.spec.name, built.engine
        try:
            oracle = self.oracle(name, model)
        except NotApplicable:
            return
        for length in SERVED_PROBE:
            prompt = of_length(length, built.spec.vocab_size, salt=43)
            reference = oracle.reference(prompt.ids, built.max_new_tokens)
            got = engine_io.generate(built.ref, engine, [prompt.ids], built.max_new_tokens, built.spec.vocab_size)[0]
            verdict = token_verdict(reference, got, built.tie_tolerance, None, built.excluded,
                                    built.host.top_logprobs(prompt.ids, got))
            bad = verdict.mismatch
            if bad is not None and bad.step == 0:
                served = f"(not asked: {built.host.unreachable})" if built.host.unreachable else \
                    engine.served.describe()
                gap = f" by a logit gap of {bad.gap:.4g}" if reference.scored else ""
                fail(
                    f"engine '{name}' does not serve model '{model}' ({built.spec.path}): a probe prompt of length "
                    f"{length}, sent alone, starts {got[:4]} where that checkpoint gives {list(reference.tokens[:4])} "
                    f"(its first token: the checkpoint prefers {bad.expected}{gap} over {bad.got}); nothing was "
                    f"judged. The server describes its model as: {served}. Start it on that checkpoint, or give the "
                    "checkpoint it serves with --kv-model=PATH --kv-zoo=none", pytrace=False)

    def oracle(self, name: str, model: str) -> StoredOracle:
        """The engine's oracle on the model (memoized, disk-cached, self-checked): with --kv-oracle=hf (default) the
        oracle of its declared strategy, in a 16-bit run the float64 truth of the model's 16-bit weights
        (oracles/precision.py); with eager or NAME an engine (oracles/engine.py)."""
        choice, strategy = self.oracles.get(name), self.engines[name].declaration.strategy
        if choice is not None and choice.ref is not None:
            found = self._engine_oracle(choice, strategy, model)
        else:
            found = self._stored(strategy, model, f"engine '{name}'")
        if isinstance(found, str):
            raise NotApplicable(found + " (the oracle-free checks still run)")
        lowered = self.engines[name].declaration.lowered()
        if lowered is not None:
            noise = self.rules(model, lowered).noise
            if noise.flip_rate_bound >= precision.VACUOUS_FLIP_RATE:
                raise Unjudgeable(
                    f"engine '{name}' computes with {lowered} ({lowered.fields}): on model "
                    f"'{model}' that alone changes the model's greedy choice at {noise.flip_rate:.0%} of positions "
                    f"(bound {noise.flip_rate_bound:.0%}), so no token check can tell a bug from it (the oracle-free "
                    "checks still run; with no token verified the engine fails as vacuous on this model)")
            return found.for_lowered(self._harness_spec(model), lowered)  # routing near ties its computation tips
        return found

    def _store_root(self, model: str) -> Path:
        """Where the oracle's references for `model` are stored: a recorded folder (--kv-references, or
        --kv-record-references, which also writes what they are recorded for), else the run's cache."""
        if self.settings.references is None:
            return self.settings.cache_dir / "oracle"
        folder = References(self.settings.references)
        if self.settings.record_references:
            folder.record(self._recorded(model))
        return folder.store

    @property
    def _digests(self) -> Path:
        """Where checkpoints' file digests are memoized (oracles/recorded.py: content_digest): this machine's cache."""
        return self.settings.cache_dir / "oracle" / "digests"

    def _recorded(self, model: str) -> Recorded:
        """What references of `model` in this run are recorded for (oracles/recorded.py)."""
        import torch
        import transformers

        spec = self._harness_spec(model)
        return Recorded(model, content_digest(Path(spec.path), self._digests),
                        self.settings.dtype, str(spec.device), code_hash("models", "oracles"), torch.__version__,
                        transformers.__version__)

    def check_references(self) -> None:
        """At start-up with --kv-references: a usage error where the folder cannot judge a model of this run (not
        recorded, or recorded for another checkpoint, dtype, device or version: oracles/recorded.py)."""
        if self.settings.references is None or self.settings.record_references:
            return
        folder = References(self.settings.references)
        for model, entry in self.models.items():
            if entry.own or entry.unavailable:  # judged by an engine oracle, or not at all: nothing recorded to load
                continue
            problem = folder.problem(self._recorded(model), REFERENCES, RECORD_REFERENCES)
            if problem:
                raise UsageError(problem)

    def _engine_oracle(self, choice: Any, strategy: Strategy, model: str) -> StoredOracle | str:
        """An engine as the oracle (oracles/engine.py), built once per oracle and model; a string: why it cannot be.
        In 16-bit on a transformers model, the equivalent 16-bit computations give the local noise term along the
        engine's tokens (oracles/precision.py), measured against this oracle's own rows."""
        from pytest_kvcompile.oracles.engine import EngineOracle

        key = (choice.key, str(strategy), model)
        if key not in self._oracles:
            spec, rules = self.spec(model), self.rules(model)
            missing = missing_capability(choice.ref.declaration, spec)
            if missing:
                found = (f"no oracle on model '{model}': "
                         f"the oracle engine '{choice.ref.name}' does not declare {missing}")
                self._oracles[key] = found
                return found
            raw = EngineOracle(choice, spec, self.settings.compile_backend, rules.tie_tolerance)
            local = precision.reduced(spec.dtype) and not self.models[model].own and strategy.kind == "exact"
            self._oracles[key] = StoredOracle(
                raw, strategy, spec, rules.tie_tolerance, self._store_root(model),
                check=self.settings.oracle_check,
                computations=precision.Computations(self._harness_spec(model)) if local else None,
                digests=self._digests)
        return self._oracles[key]

    def _stored(self, strategy: Strategy, model: str, who: str) -> StoredOracle | str:
        key = (str(strategy), model)
        if key not in self._oracles:
            if self.models[model].own:
                why = self.models[model].config.unreadable
                self._oracles[key] = (f"no oracle for {who} on model '{model}': it is not a transformers checkpoint "
                                      f"(transformers cannot read its config.json: {why}), so the hf oracle cannot "
                                      "load it; check it against the engine's eager mode (--kv-oracle=eager) or "
                                      "another engine (--kv-oracle=NAME)")
                return self._oracles[key]
            spec = self._harness_spec(model)
            reduced = precision.reduced(spec.dtype)
            judged = precision.high_precision(spec) if reduced else spec
            try:
                raw = oracle_for(strategy, judged)
            except (NoOracle, ModelNotSupported) as exc:
                self._oracles[key] = f"no oracle for {who} on model '{model}': {exc}"
            except UsageError:
                raise
            except Exception as exc:  # not the engine's failure: its token checks there are not judged, named
                self._oracles[key] = OracleUnavailable(could_not_run(judged, f"the oracle of {who}", "load", exc))
            else:
                exact = strategy.kind == "exact"
                # the noise of equivalent 16-bit computations along an engine's tokens (exact attention only)
                computations = precision.Computations(spec) if reduced and exact else None
                stored = self._oracles[key] = StoredOracle(
                    raw, strategy, judged, self.settings.tie_tolerance or 0.0, self._store_root(model),
                    # a 16-bit run's eviction truth is float64 already: its float64 replay would be itself
                    check=self.settings.oracle_check and (exact or not reduced), computations=computations,
                    digests=self._digests, reach=lambda: self._reach(model))
                if reduced and hasattr(raw, "eviction_tie_tolerance"):  # the engine's evictions are 16-bit choices
                    stored.measure_score_noise(spec)
        if isinstance(self._oracles[key], OracleUnavailable):
            raise OracleUnavailable(self._oracles[key].msg)
        return self._oracles[key]

    def _engine_rules(self, model: str, lowered: Lowered | None) -> precision.Rules:
        """The engine's verdict numbers: where what it declares it computes lower cannot be measured on this model (no
        transformers oracle), the model's own, which are stricter (its token checks then skip, named: `oracle`)."""
        try:
            return self.rules(model, lowered)
        except NotApplicable:
            if lowered is None:
                raise
            return self.rules(model)

    def rules(self, model: str, lowered: Lowered | None = None) -> precision.Rules:
        """The verdict numbers on `model`: the options' values, and for 16-bit 'auto' ones the model's measured
        noise (oracles/precision.py); for an engine computing lower as it declares (`Lowered`: its KV cache stored
        lower, its matmul inputs quantised), the larger of those and that computation's measured noise."""
        if lowered is not None:
            key = (model, lowered)
            if key not in self._rules:
                truth = self._stored(Strategy(), model, f"the noise of computing with {lowered}")
                if isinstance(truth, str):
                    raise NotApplicable(truth)
                kv = truth.kv_noise(self._harness_spec(model), lowered, self._attends(model))
                self.progress(f"{model}: {kv.describe()}")
                self._rules[key] = self.rules(model).with_kv(kv, self.settings.max_new_tokens)
            return self._rules[key]
        if model not in self._rules:
            settings = self.settings
            noise = None
            if precision.reduced(settings.dtype) and self.models[model].own:
                unset = [flag for flag, value in ((TIE_TOLERANCE, settings.tie_tolerance), (MAX_NEAR_TIES,
                         settings.max_near_ties), (MAX_NEAR_TIE_RATE, settings.max_near_tie_rate)) if value is None]
                if unset:  # the 16-bit noise is measured with transformers (oracles/precision.py)
                    raise NotApplicable(f"model '{model}' is not a transformers checkpoint, so its {settings.dtype} "
                                        "noise cannot be measured (oracles/precision.py runs it through "
                                        f"transformers): give {', '.join(unset)} explicitly for 16-bit verdicts on it")
            elif precision.reduced(settings.dtype):
                truth = self._stored(Strategy(), model, "the noise calibration")
                if isinstance(truth, str):
                    raise NotApplicable(truth)
                noise = truth.noise(self._attends(model))
            self._rules[model] = precision.Rules.of(settings, noise)
        return self._rules[model]

    def _reach(self, model: str) -> float:
        """The position term of `model`'s measured 16-bit noise (precision.Noise.reach), for every oracle store of it
        whichever strategy's store measured it; 0 before its rules exist (no such term)."""
        rules = self._rules.get(model)
        return rules.noise.reach if rules is not None and rules.noise is not None else 0.0

    def _attends(self, model: str) -> int | None:
        """The most positions the run's token checks attend on `model` where its --kv-profile bounds them (None: every
        length): the 16-bit calibration measures the noise that far (oracles/precision.py: long_prompts)."""
        entry = self.models[model]
        return PROFILES[self.settings.profile].attends({p.name: len(p) for p in self.prompts(model)},
                                                       [len(p) for p in batch(entry.vocab_size, entry.window)],
                                                       self.settings.max_new_tokens, self.selection)

    def engine_named(self, name: str, model: str, why: str) -> EngineUnderTest:
        """An engine the run did not select (a relative latency budget's), resolved now and built for `model`;
        a name that does not resolve fails the test with `why`."""
        from pytest_kvcompile.contract import registry
        from pytest_kvcompile.errors import EngineResolutionError

        __tracebackhide__ = True
        if name not in self.engines:
            try:
                self.engines[name] = registry.resolve(name)
            except EngineResolutionError as exc:
                fail(f"{why}: {exc}", pytrace=False)
        return self.engine(name, model)
