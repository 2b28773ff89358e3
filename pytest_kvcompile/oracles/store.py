"""The run's view of an oracle: references memoized in memory and on disk, and checked against an
independent path before any engine is judged by them.

Disk cache: every greedy reference and teacher-forced run is stored under ``<cache dir>/oracle/``, keyed by the
oracle's fingerprint (oracle class and its source code, the hash of the code under models/ and oracles/, strategy,
checkpoint contents, device, dtype, torch and transformers versions) and the call's tokens, so workers (``-n``) and
later runs reuse them: an edit to any file there computes them anew. Files are written to a temporary name and
renamed (race-safe under xdist). A calibration (16-bit noise, a stored-lower KV's noise, routers, eviction scores) is
claimed while computed (`DiskMemo.claimed`): a second process needing it waits and loads it rather than measuring it
again beside the first on the same cores.

Judging along the engine's tokens (issue 54): an exact transformers oracle teacher-forces in one forward
(``one_forward``), so `reference` gives a `LazyReference`: the verdict reads the oracle's logits along the engine's own
tokens (`judged`: one forward per distinct sequence, shared by every engine that produced it) and the oracle's greedy
loop runs only where its tokens are read (a failure's message, a check that needs the oracle's own path). Eviction
and engine oracles give their greedy reference at once, as before.

Self-check (the oracle checks itself) against an independent path in float64 (`independent`): for the ``exact``
strategy a full recompute without a cache (one forward over prompt + tokens); for other strategies, or models whose
transformers code needs a cache to run correctly (KV-sharing layers), the same oracle in float64. Each judged
sequence's rows (`judged`, where the oracle runs below float64: a 16-bit run's oracle is the float64 truth itself)
and each greedy reference the first time it is used: if the oracle's choice at some step is more than
`ORACLE_CHECK_TOLERANCE` (per dtype) behind that path's best, the oracle is unreliable for this model:
`OracleUnreliable` names transformers, model, prompt and step, and every token check on that model from then on
stops with that error: never a verdict on the engine.

The tolerance is the oracle's own rounding, not the engine's tie tolerance. float32: 1e-3 (measured differences
~1e-5). A 16-bit run's hf oracle is the float64 truth: 1e-6. An engine oracle run in 16-bit: bfloat16 1.0, float16
0.25 (a bfloat16 oracle trailed its float64 path by up to 0.19 on the CPU zoo and 0.766 on an H100,
docs/gpu-results.md), while a cache bug moves logits by whole units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks; concurrent processes may compute a calibration twice)
    fcntl = None

from pytest_kvcompile.contract.engine import Lowered, ModelSpec, Strategy, dtype_name
from pytest_kvcompile.errors import COULD_NOT_RUN, OracleUnavailable, OracleUnreliable, UsageError
from pytest_kvcompile.models.checkpoints import keep_last
from pytest_kvcompile.models.zoo import code_hash, shared_kv_layers
from pytest_kvcompile.oracles import computations as equivalent
from pytest_kvcompile.oracles import precision, routing
from pytest_kvcompile.oracles.engine import EngineOracle
from pytest_kvcompile.oracles.eviction import EVICTION_TIE_TOLERANCE
from pytest_kvcompile.oracles.eviction_noise import ScoreNoise, calibrate_scores
from pytest_kvcompile.oracles.hf import oracle_for
from pytest_kvcompile.oracles.recorded import content_digest
from pytest_kvcompile.oracles.reference import LazyReference, Reference
from pytest_kvcompile.oracles.truth import Widened, load_lm
from pytest_kvcompile.verdicts.rows import OracleFacts

#: How far behind the independent path's best the oracle's own token may be, per dtype (module docstring).
#: bfloat16 from data: the bfloat16 oracle's own tokens trailed its float64 path by up to 0.766 (H100,
#: docs/gpu-results.md).
ORACLE_CHECK_TOLERANCE = {"float32": 1e-3, "float64": 1e-6, "float16": 0.25, "bfloat16": 1.0}
#: how long a process waits for another computing the same calibration (`DiskMemo.claimed`) before computing it too
CLAIM_WAIT_S = 900.0


_PRECISION = hashlib.sha256((inspect.getsource(precision) + inspect.getsource(equivalent)).encode()).hexdigest()[
    :12]  # the rule's version, in keys
_ROUTING = hashlib.sha256(inspect.getsource(routing).encode()).hexdigest()[:12]


class NoCacheRecompute:
    """transformers eager, no cache, one forward over prompt + tokens (the exact strategy's independent path)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    @functools.cached_property
    def model(self) -> Any:  # on first use: rows found in the disk store need none
        return load_lm(self.spec, widened=True)

    @torch.inference_mode()
    def teacher_forced(self, prompt: Sequence[int], tokens: Sequence[int], tie_tolerance: float = 0.0) -> torch.Tensor:
        ids = torch.tensor([list(prompt) + list(tokens)[:-1]], device=self.spec.device)
        # only the best token and the gaps up to tie_tolerance are read (_check_rows): a sliced head is screened
        call = functools.partial(self.model.screened, tie_tolerance) if isinstance(self.model, Widened) else self.model
        logits = call(input_ids=ids, use_cache=False, **keep_last(self.model, len(tokens))).logits
        return logits[0, -len(tokens):].float().cpu()


def independent(strategy: Strategy, spec: ModelSpec, oracle: Any = None) -> tuple[Any, str]:
    """The independent path for `strategy` on `spec`, and its name for messages (path None: there is none, the name
    says why). An engine oracle (oracles/engine.py) names its own. An eviction oracle's float64
    replay accepts eviction near ties with float32's tolerance (its choices may differ from float64's exactly where
    the scores are that close); a 16-bit run's eviction oracle is the float64 truth already and is not replayed."""
    if isinstance(oracle, EngineOracle):
        return oracle.independent()
    wide = dataclasses.replace(spec, dtype=torch.float64)
    if strategy.kind == "exact" and not shared_kv_layers(spec.config):
        return NoCacheRecompute(wide), "transformers eager in float64 without a cache (one full recompute)"
    why = ("its KV-sharing layers compute their own K/V without a cache in some transformers versions"
           if strategy.kind == "exact" else f"the '{strategy.kind}' oracle has no cache-free form")
    path = oracle_for(strategy, wide)
    if hasattr(path, "eviction_tie_tolerance"):
        path.eviction_tie_tolerance = EVICTION_TIE_TOLERANCE["float32"]  # float32 runs: 16-bit ones are not replayed
    return path, f"the same oracle in float64 (not cache-free: {why})"


def _fingerprint(oracle: Any, strategy: Strategy, spec: ModelSpec, memo: Path | None = None) -> str:
    """The oracle store's key: the oracle, its code, the strategy, the checkpoint's content (`content_digest`: the same
    wherever the checkpoint is copied, so a store recorded elsewhere is found), device, dtypes and versions."""
    from importlib.metadata import version

    module = sys.modules[type(oracle).__module__]
    who = oracle.identity() if isinstance(oracle, EngineOracle) else version("transformers")  # an engine: its own
    parts = [type(oracle).__qualname__, inspect.getsource(module), code_hash("models", "oracles"), str(strategy),
             content_digest(Path(spec.path), memo), str(spec.device), dtype_name(spec.dtype),
             str(getattr(spec, "weights_dtype", "")), torch.__version__, who]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


class DiskMemo:
    """tensors by key under one directory; load() None when absent or unreadable."""

    def __init__(self, root: Path | None):
        self.root = root

    def _path(self, key: tuple) -> Path:
        return self.root / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".pt")

    def load(self, key: tuple) -> Any:
        if self.root is None:
            return None
        try:
            return torch.load(self._path(key), weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError):
            return None

    @contextlib.contextmanager
    def claimed(self, key: tuple) -> Iterator[None]:
        """Held while this process computes `key`: another process (an xdist worker, a run beside this one) computing
        the same key waits here and then loads the result, instead of computing it twice (a 16-bit calibration: 15-140 s
        on 2 cores). An advisory lock on a file beside the entry, released when the holder ends or dies; waiting stops
        after `CLAIM_WAIT_S` (the key is then computed here too, as without a lock), and where no lock can be taken
        (no fcntl, a read-only store) nothing waits."""
        if self.root is None or fcntl is None:
            yield
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path(key).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            deadline = time.monotonic() + CLAIM_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)

    def save(self, key: tuple, value: Any) -> None:
        if self.root is None:
            return
        try:  # a store that cannot be written (a recorded folder mounted read-only) only memoizes in memory
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as out:
                torch.save(value, out)
            os.replace(tmp, self._path(key))
        except OSError:
            Path(tmp).unlink(missing_ok=True)


class StoredOracle:
    """An oracle as the run uses it: `reference` and `teacher_forced` memoized (memory and disk), and each
    prompt's reference checked once against the independent path (module docstring)."""

    def __init__(self, oracle: Any, strategy: Strategy, spec: ModelSpec, tie_tolerance: float,
                 cache_root: Path | None, check: bool = True, computations: Any = None, digests: Path | None = None,
                 reach: Callable[[], float] | None = None):
        self.oracle, self.strategy, self.spec, self.tie_tolerance = oracle, strategy, spec, tie_tolerance
        self.source = oracle.source
        # `digests`: where checkpoints' file digests are memoized (default: beside the store), kept out of a recorded
        # folder, whose copies would carry this machine's paths
        self._disk = DiskMemo(cache_root / _fingerprint(oracle, strategy, spec, digests or cache_root / "digests")
                              if cache_root else None)
        self._memo: dict[tuple, Any] = {}
        self._measured: set[tuple] = set()  # the keys this store computed (not read from disk)
        self._check = check
        # 16-bit (oracles/precision.py): the equivalent computations in the run's dtype, for the noise along tokens
        self.computations = computations
        # the model's measured noise's position term (precision.Noise.reach) for the local noise; none: 0, no such term
        self._reach = reach or (lambda: 0.0)
        self._independent: tuple[Any, str] | None = None
        self.check_absent: str | None = None  # why no independent path exists for this oracle (reported)
        self._checked: set[tuple] = set()
        self.unreliable: str | None = None
        self.unavailable: str | None = None  # why the oracle could not run on the model (`_ran`)
        self.score_noise: ScoreNoise | None = None  # 16-bit eviction oracles: the measured noise of the policy's cuts

    def measure_score_noise(self, spec: ModelSpec) -> None:
        """16-bit runs of a scoring eviction policy: measure its cuts' noise in `spec` (the run's dtype) against this
        oracle, the float64 truth (eviction_noise.calibrate_scores; memoized), and let the oracle's forks follow it and
        one alternative take the cuts of the policy computed in that dtype (`EvictionOracle.guided_by`)."""
        if not getattr(getattr(self.oracle, "policy", None), "scored", False):
            return
        self.oracle.guided_by(spec, self.strategy)  # its 16-bit oracle also measures the noise (built on a miss only)
        found = self._cached(("score_noise", _PRECISION, dtype_name(spec.dtype)),
                             lambda: calibrate_scores(spec, self.strategy, self.oracle, self.oracle.guide()).to_dict(),
                             claim=True)
        self.score_noise = ScoreNoise.from_dict(found)
        self.oracle.eviction_tie_tolerance = self.score_noise.tolerance

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    def facts(self) -> OracleFacts:
        """The oracle as the reports show it: its source, and what it cannot do (named, never silent)."""
        engine = isinstance(self.oracle, EngineOracle)
        limits = self.oracle.limitations() if engine else []
        if self.check_absent:
            limits.append(f"no float64 self-check of the oracle ({self.check_absent})")
        if engine and self.strategy.kind != "exact":  # an engine oracle of an eviction engine
            limits.append(f"the oracle engine reports no evictions, so whether strategy {self.strategy} had to evict "
                          "is not checked")
        return OracleFacts(self.source, engine, limits)

    def __getattr__(self, name: str) -> Any:  # oracle-specific extras (kept(), evicted(), ...)
        if name == "oracle":
            raise AttributeError(name)
        return getattr(self.oracle, name)

    def _cached(self, key: tuple, compute, claim: bool = False) -> Any:
        """`compute()` under `key`, memoized in memory and on disk; `claim`: a calibration, computed by one process at a
        time (`DiskMemo.claimed`: the others wait and load it). Calibrations do not claim each other's keys in a
        cycle (a KV calibration reads references, never another calibration), so claims cannot deadlock."""
        if key not in self._memo:
            found = self._disk.load(key)
            if found is None:
                with self._disk.claimed(key) if claim else contextlib.nullcontext():
                    found = self._disk.load(key) if claim else None
                    if found is None:
                        found = self._ran(key[0], compute)
                        self._disk.save(key, found)
                        self._measured.add(key)
            self._memo[key] = found
        return self._memo[key]

    def _ran(self, what: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, the oracle's work named `what` (a store key's kind); where it raises, this oracle cannot run on
        the model: OracleUnavailable with the cause (`could_not_run`), now and for every later computation."""
        if self.unavailable:
            raise OracleUnavailable(self.unavailable)
        try:
            return compute()
        except UsageError:
            raise
        except Exception as exc:
            self.unavailable = self.unreliable = could_not_run(self.spec, self.source, what, exc)
            raise OracleUnavailable(self.unavailable) from None

    @property
    def lazy(self) -> bool:
        """Whether references are judged by teacher-forcing the engine's tokens in one forward (`LazyReference`), the
        greedy reference decoded only where read: an exact transformers oracle. Eviction oracles (whose cache
        evicts as it decodes) and engine oracles give their greedy references as before."""
        return bool(getattr(self.oracle, "one_forward", False))

    def reference(self, prompt: Sequence[int], max_new_tokens: int,
                  routing_tolerance: Callable[[], float] | None = None) -> Reference | LazyReference:
        """The oracle's reference for `prompt`. A lazy oracle: a `LazyReference`, whose verdicts read the oracle's
        logits along the engine's tokens (`judged`) and whose greedy tokens are decoded on first read (then
        self-checked). Else the greedy reference, after the self-check of this prompt (OracleUnreliable if it
        fails). `routing_tolerance`: `_routes_of`'s."""
        prompt = tuple(int(t) for t in prompt)
        if self.lazy:
            noise = (lambda got: self.local_noise(prompt, got)) if self.computations is not None else None
            return LazyReference(prompt, max_new_tokens, self.source,
                                 lambda: self._greedy(prompt, max_new_tokens, routing_tolerance),
                                 lambda got, tol: self.judged(prompt, got, tol), noise,
                                 self._routes_of(prompt, routing_tolerance))
        return self._greedy(prompt, max_new_tokens, routing_tolerance)

    def _routes_of(self, prompt: tuple[int, ...],
                   tolerance: Callable[[], float] | None) -> Callable[[Any, int], list] | None:
        """The routing alternatives a reference of `prompt` follows (`routes`; None: none): within `tolerance()` where
        given (an engine computing lower: `LoweredView`, measured on first use), else, in a 16-bit run of a
        mixture-of-experts model, within the run's measured router noise."""
        if not self.lazy or (tolerance is None and not self.routed):
            return None
        return lambda got, step: self.routes(prompt, got, step, None if tolerance is None else tolerance())

    def _greedy(self, prompt: tuple[int, ...], max_new_tokens: int,
                routing_tolerance: Callable[[], float] | None = None) -> Reference:
        ref = self.cached_reference(prompt, max_new_tokens, routing_tolerance)
        self.self_check(ref)
        return ref

    def judged(self, prompt: Sequence[int], tokens: Sequence[int], tie_tolerance: float) -> torch.Tensor:
        """The oracle's logits along `tokens` (`teacher_forced`), self-checked where the oracle runs below float64:
        at every step the oracle's best must not trail the independent path's best there by more than its rounding
        allowance (`ORACLE_CHECK_TOLERANCE`), else OracleUnreliable (the sequence is not judged)."""
        prompt, tokens = tuple(int(t) for t in prompt), tuple(int(t) for t in tokens)
        rows = self.teacher_forced(prompt, tokens, tie_tolerance)
        if self._check and tokens and self.spec.dtype != torch.float64:
            self._check_rows(prompt, tokens, rows.argmax(-1).tolist(), "its logits along the engine's tokens")
        elif self.unreliable:
            raise OracleUnreliable(self.unreliable)
        return rows

    def cached_reference(self, prompt: Sequence[int], max_new_tokens: int,
                         routing_tolerance: Callable[[], float] | None = None) -> Reference:
        """The oracle's greedy reference, memoized, not yet self-checked (the noise calibration's: its prompts are the
        power check's, suites/test_near_tie_rate.py, which then finds them here); `routing_tolerance`: as
        `_routes_of`'s."""
        prompt = tuple(int(t) for t in prompt)

        def compute():
            ref = self.oracle.reference(prompt, max_new_tokens)
            evicted = getattr(self.oracle, "evicted", None)
            return {"tokens": torch.tensor(ref.tokens, dtype=torch.long),
                    "logits": ref.logits if ref.scored else torch.empty(0), "scored": ref.scored,
                    "evicted": -1 if evicted is None else int(evicted(prompt, max_new_tokens))}

        found = self._cached(("reference", prompt, max_new_tokens), compute)
        noise = (lambda got: self.local_noise(prompt, got)) if self.computations is not None else None
        forks = getattr(self.oracle, "alternatives", None)
        scored = found.get("scored", True)
        ref = Reference(prompt, tuple(found["tokens"].tolist()), found["logits"] if scored else None, self.source,
                        (lambda got, tol: self.teacher_forced(prompt, got, tol)) if scored else None,
                        None if found["evicted"] < 0 else found["evicted"], noise,
                        (lambda got, tol: forks(prompt, got, tol)) if forks else None,
                        self._routes_of(prompt, routing_tolerance))
        return ref

    @functools.cached_property
    def routed(self) -> bool:
        """Whether verdicts follow near-tied routing alternatives (oracles/routing.py): a 16-bit run's exact truth on a
        mixture-of-experts model."""
        return self.computations is not None and bool(routing.blocks(self.oracle.model))

    def router_noise(self, spec: ModelSpec | None = None, lowered: Lowered | None = None) -> routing.RouterNoise:
        """The routers' measured noise (routing.calibrate: this oracle against the model computed otherwise, on the
        first calibration prompts, along the oracle's tokens), memoized: of the run's 16-bit computations (the model in
        the run's dtype, its latent attention also absorbed), or, `lowered`, of computing lower as an engine declares
        (a KVComputation in `spec`'s dtype: its KV cache stored lower, its matmul inputs quantised)."""
        spec = spec or self.computations.spec
        _, steps, _ = precision.CALIBRATION
        key = ("router_noise", _ROUTING, _PRECISION) + (() if lowered is None else (dtype_name(spec.dtype),
                                                                                      lowered.key))

        def compute() -> dict[str, Any]:
            prompts = precision.calibration_prompts(spec.vocab_size, 1)[:routing.CALIBRATION_PROMPTS]
            sequences = [p + list(self.cached_reference(p, steps).tokens[:-1]) for p in prompts]
            computed = [c for c in (self.computations.base, self.computations.absorbed) if c is not None] \
                if lowered is None else [precision.KVComputation(spec, lowered)]
            return routing.calibrate(spec.name, dtype_name(spec.dtype), self.oracle.model, computed, sequences,
                                     spec.device, precision.NOISE_FACTOR, precision.QUANTILE,
                                     "" if lowered is None else str(lowered)).to_dict()

        return routing.RouterNoise.from_dict(self._cached(key, compute, claim=True))

    def routes(self, prompt: Sequence[int], tokens: Sequence[int], step: int,
               tolerance: float | None = None) -> list[tuple[routing.Route, Any]]:
        """The truth at `step` along prompt + `tokens` with near-tied routing decisions taken the other way
        (routing.alternatives, within `tolerance`, by default `router_noise`'s), memoized."""
        prompt, before = tuple(int(t) for t in prompt), tuple(int(t) for t in tokens[:step])
        tolerance = self.router_noise().tolerance if tolerance is None else tolerance

        def compute() -> dict[str, Any]:
            found = routing.alternatives(self.oracle.model, prompt + before, self.spec.device, tolerance)
            return {"routes": [route.to_list() for route, _ in found],
                    "rows": torch.stack([row for _, row in found]) if found else torch.empty(0)}

        found = self._cached(("routes", _ROUTING, prompt, before, tolerance), compute)
        return [(routing.Route.from_list(r), row) for r, row in zip(found["routes"], found["rows"], strict=True)]

    def for_lowered(self, spec: ModelSpec, lowered: Lowered) -> StoredOracle | LoweredView:
        """This store as an engine computing lower as it declares (`lowered`, in `spec`: the run's dtype) is judged by
        it: where its references follow routing alternatives (an exact transformers oracle of a mixture-of-experts
        model), a `LoweredView`; else the store itself."""
        if not self.lazy or not routing.blocks(self.oracle.model):
            return self
        return LoweredView(self, spec, lowered)

    def teacher_forced(self, prompt: Sequence[int], tokens: Sequence[int], tie_tolerance: float) -> torch.Tensor:
        prompt, tokens = tuple(int(t) for t in prompt), tuple(int(t) for t in tokens)
        eviction = getattr(self.oracle, "eviction_tie_tolerance", None)
        return self._cached(("forced", prompt, tokens, tie_tolerance) + ((eviction,) if eviction is not None else ()),
                            lambda: self.oracle.teacher_forced(prompt, tokens, tie_tolerance))

    def local_noise(self, prompt: Sequence[int], tokens: Sequence[int]) -> precision.LocalNoise:
        """The equivalent 16-bit computations' logits along prompt + tokens (precision.LocalNoise), memoized."""
        prompt, tokens = tuple(int(t) for t in prompt), tuple(int(t) for t in tokens)
        rows = self._cached(("computations", _PRECISION, prompt, tokens),
                            lambda: self.computations.along(prompt, tokens).float())
        rounding = (lambda: self._cached(("computations pinned", _PRECISION, _ROUTING, prompt, tokens),
                                         lambda: self.computations.along(prompt, tokens, pinned=True).float())) \
            if getattr(self.computations, "routed", False) else None
        return precision.LocalNoise(rows, self._reach(), rounding)

    def noise(self, needed: int | None = None) -> precision.Noise:
        """This model's measured 16-bit noise (precision.calibrate over this oracle, the truth), memoized; `needed`:
        the most positions the run's checks attend (a smaller --kv-profile's, `_calibration`)."""
        spec, computations = self.computations.spec, self.computations
        found = self._calibration(("noise", _PRECISION), precision.limited_to(spec, needed),
                                  lambda: precision.calibrate(spec, self._memoized, computations, needed).to_dict())
        return self._noise(found)

    def _noise(self, found: dict[str, Any]) -> precision.Noise:
        """A stored calibration as Noise, `cached` where this store did not measure it."""
        return dataclasses.replace(precision.Noise.from_dict(found),
                                   cached=not any(self._memo.get(k) is found for k in self._measured))

    def _calibration(self, key: tuple, limited: int | None, compute: Callable[[], Any]) -> Any:
        """A calibration stored under `key`; one `limited` to as many positions (precision.limited_to) under its own
        key, or the whole calibration where the store holds it and not the limited one (a nightly run's recording
        serves a smoke run): whichever the store holds first stays the one used, so verdicts do not change with it."""
        if limited is None:
            return self._cached(key, compute, claim=True)
        own = (*key, "up to", limited)
        if own not in self._memo and self._disk.load(own) is None:
            whole = self._memo.get(key) or self._disk.load(key)
            if whole is not None:
                self._memo[own] = whole
        return self._cached(own, compute, claim=True)

    @property
    def _memoized(self) -> Any:
        """This oracle for the calibration: its references memoized with the rest (`cached_reference`)."""
        return types.SimpleNamespace(reference=self.cached_reference)

    def kv_noise(self, spec: ModelSpec, lowered: Lowered | str, needed: int | None = None) -> precision.Noise:
        """The noise of computing lower as an engine declares (`Lowered`: a KV cache stored as a format, matmul
        inputs quantised; a str: the KV format alone) on this model in `spec`'s dtype (the run's), against this oracle
        (precision.calibrate over a KVComputation), memoized; `needed`: as `noise`'s."""
        lowered = Lowered(lowered) if isinstance(lowered, str) else lowered
        computations = lambda: precision.KVComputation(spec, lowered)  # noqa: E731 (loaded on a store miss only)
        found = self._calibration(("kv_noise", _PRECISION, dtype_name(spec.dtype), lowered.key),
                                  precision.limited_to(spec, needed),
                                  lambda: precision.calibrate(spec, self._memoized, computations(), needed).to_dict())
        return self._noise(found)

    def self_check(self, ref: Reference) -> None:
        """Raise OracleUnreliable if the independent path rejects one of the oracle's greedy tokens."""
        if self.unreliable:
            raise OracleUnreliable(self.unreliable)
        if not self._check or not ref.tokens:
            return
        self._check_rows(ref.prompt, ref.tokens, ref.tokens, "the oracle")

    def _check_rows(self, prompt: tuple[int, ...], tokens: tuple[int, ...], chosen: Sequence[int], what: str) -> None:
        """The independent path teacher-forced along `tokens`: at each step the oracle's `chosen` token must not trail
        its best by more than ORACLE_CHECK_TOLERANCE, else this oracle is unreliable on the model."""
        if self.unreliable:
            raise OracleUnreliable(self.unreliable)
        key = (prompt, tokens)
        if key in self._checked:
            return
        if self._independent is None:
            self._independent = self._ran("independent", lambda: independent(self.strategy, self.spec, self.oracle))
        path, name = self._independent
        if path is None:
            self.check_absent = name
            return
        tolerance = ORACLE_CHECK_TOLERANCE[dtype_name(self.spec.dtype)]
        rows = self._cached(("independent", prompt, tokens, tolerance),
                            lambda: path.teacher_forced(prompt, tokens, tolerance))
        for step, token in enumerate(chosen):
            best = int(rows[step].argmax())
            gap = float(rows[step][best] - rows[step][token])
            if gap > tolerance:
                from importlib.metadata import version

                who = "" if isinstance(self.oracle, EngineOracle) else f"transformers {version('transformers')}, "
                self.unreliable = (
                    f"oracle unreliable: {who}torch {torch.__version__}, model "
                    f"'{self.spec.name}' ({dtype_name(self.spec.dtype)}, {self.spec.device}), prompt of length "
                    f"{len(prompt)} ...{list(prompt[-4:])}, step {step}: {what} ({self.source}) chose "
                    f"{token}, but {name} prefers {best} by {gap:.4g} > {tolerance:g} "
                    f"(the oracle's rounding allowance in "
                    f"{dtype_name(self.spec.dtype)}). The "
                    "oracle's references cannot judge an engine on this model, so its token checks there are skipped "
                    "as not judged (this is not a verdict on the engine). " + (
                        "Check the oracle engine: its run-dtype path and its float64 path disagree" if who == "" else
                        "Check the model's transformers implementation (cache bugs ship in released versions), or "
                        "run another transformers version")
                )
                raise OracleUnreliable(self.unreliable)
        self._checked.add(key)


class LoweredView:
    """A store as an engine computing lower (Declaration.lowered: a KV cache stored lower, matmul inputs quantised)
    is judged by it on a mixture-of-experts model (`StoredOracle.for_lowered`): its references follow near-tied routing
    alternatives within the larger of that computation's measured router noise (`StoredOracle.router_noise`) and, in
    a 16-bit run, the run's own: a KV cache stored in float16 tips a router's near tie in a float32 run as 16-bit
    rounding does, and its measured tie tolerance (the routers pinned: rounding alone) leaves the swap to them.
    Everything else is the store's."""

    def __init__(self, store: StoredOracle, spec: ModelSpec, lowered: Lowered):
        self.store, self.spec_lowered, self.lowered_as = store, spec, lowered

    def __getattr__(self, name: str) -> Any:
        if name == "store":
            raise AttributeError(name)
        return getattr(self.store, name)

    def __repr__(self) -> str:
        return f"{self.store!r} with {self.lowered_as}"

    @functools.cached_property
    def noise(self) -> routing.RouterNoise:
        """The lowered computation's measured router noise (the reports show it)."""
        return self.store.router_noise(self.spec_lowered, self.lowered_as)

    @functools.cached_property
    def routing_tolerance(self) -> float:
        own = self.store.router_noise().tolerance if self.store.routed else 0.0
        return max(own, self.noise.tolerance)

    def reference(self, prompt: Sequence[int], max_new_tokens: int) -> Reference | LazyReference:
        return self.store.reference(prompt, max_new_tokens, lambda: self.routing_tolerance)

    def cached_reference(self, prompt: Sequence[int], max_new_tokens: int) -> Reference:
        return self.store.cached_reference(prompt, max_new_tokens, lambda: self.routing_tolerance)


#: what each of the store's computations is, for a message naming where the oracle could not run (`_ran`), and what
#: to try there besides another transformers version
_STAGES = {
    "load": ("loading it", "--kv-oracle=eager (the engine's own eager mode as the oracle)"),
    "reference": ("its greedy decode", "--kv-oracle=eager (the engine's own eager mode as the oracle)"),
    "forced": ("its teacher-forced forward along the engine's tokens",
               "--kv-oracle=eager (the engine's own eager mode as the oracle)"),
    "independent": ("its float64 self-check", "--kv-oracle-check=off (the oracle without its float64 self-check: "
                    "its near ties are then not checked against float64)"),
    "computations": ("the equivalent 16-bit computations of the noise calibration",
                     "--kv-tie-tolerance, --kv-max-near-ties and --kv-max-near-tie-rate given explicitly"),
    "noise": ("the 16-bit noise calibration",
              "--kv-tie-tolerance, --kv-max-near-ties and --kv-max-near-tie-rate given explicitly"),
    "kv_noise": ("the noise calibration of what the engine declares it computes lower (its KV cache dtype, matmul "
                 "inputs)", "a run without Declaration.kv_cache_dtype and matmul_inputs"),
    "score_noise": ("the 16-bit eviction noise calibration", "a float32 run (--kv-dtype=float32)"),
    "router_noise": ("the router noise calibration of a mixture-of-experts model (oracles/routing.py)",
                     "a float32 run (--kv-dtype=float32) of an engine declaring no kv_cache_dtype or matmul_inputs"),
    "routes": ("the truth with near-tied routing decisions taken the other way (oracles/routing.py)",
               "a float32 run (--kv-dtype=float32) of an engine declaring no kv_cache_dtype or matmul_inputs"),
}


def could_not_run(spec: ModelSpec, source: str, what: str, exc: BaseException) -> str:
    """The message of an oracle that raised `exc` in its computation `what` on `spec`'s model: the cause, the frame
    that raised it, what to try; never a verdict on the engine."""
    import traceback
    from importlib.metadata import version

    stage, fix = _STAGES.get(what, (f"its '{what}' computation", "--kv-oracle=eager"))
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
    return (f"{COULD_NOT_RUN} on model '{spec.name}' ({dtype_name(spec.dtype)}, {spec.device}): "
            f"{type(exc).__name__}: {cause}{where}, in {stage} ({source}; transformers {version('transformers')}, "
            f"torch {torch.__version__}). Its token checks on this model are not judged (no verdict on the engine); "
            f"try {fix}, or another transformers version")
