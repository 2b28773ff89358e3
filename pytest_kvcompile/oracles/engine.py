"""Any engine as the oracle (``--kv-oracle``): "against eager" for models and engines transformers does not have.

The three oracle kinds, per engine (``Settings.oracle``):

- ``hf`` (default): the built-in oracle of the engine's declared strategy, transformers eager (oracles/hf.py).
- ``eager``: the engine's declared eager counterpart (``Declaration(eager="NAME")``), else, for an engine declaring
  compiled=True, the engine's own factory built anew, every call of it (build included) under
  ``torch.compiler.set_stance("force_eager")`` (a usage error for an engine that is neither: it would be its own
  oracle). A recorder around each call checks it ran eager as far as dynamo and CUDA graphs show: a dynamo compile,
  a guard hit (compiled code ran) or a CUDA graph capture there is `OracleNotEager`, a failure (compiled against
  compiled proves nothing); compiled code dynamo never sees (AOT-compiled libraries) is not observable this way.
- ``NAME``: any resolvable engine (built-in, entry point, import path), as it runs.

A reference engine must declare the engine's strategy (a usage error otherwise). It is built and called in the
pytest process, even where the engine itself is isolated (run/isolation.py).

Rule: the reference is the oracle engine's ``generate()`` of one prompt at a time, in the run's dtype and device.
Near ties are judged on its ``score()`` (teacher-forced logits) when it declares scoring, after checking that
score() agrees with its own generate() (each generated token its argmax up to the tie tolerance; otherwise the
oracle is unreliable: not judged, or, where the oracle is the engine's own code under force_eager, the engine
fails: its score() breaks the contract); an oracle engine that raises on a prompt leaves that prompt not judged.
Without scoring the reference has no logits and every token must be equal
(``Reference.scored``; reported as a limitation). The float64 self-check (oracles/store.py) replays the oracle's
tokens through the same oracle engine built in float64 when it declares float64 and scoring; otherwise it is
reported absent. The reference cache is keyed by `identity` (engine, its code and version, mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytest_kvcompile.contract import engine_io
from pytest_kvcompile.contract.engine import ModelSpec, dtype_name
from pytest_kvcompile.contract.registry import EngineRef
from pytest_kvcompile.errors import Failed, OracleUnreliable, UsageError, fail
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.recompiles.recorder import CompileRecorder

HF, EAGER = "hf", "eager"


@dataclass(frozen=True)
class Choice:
    """An engine's oracle as resolved at start-up: `oracle` hf | eager | engine (``--kv-oracle``'s hf, eager or a
    NAME); `ref` the reference engine (None for hf); `forced`: run `ref` under force_eager (eager without a declared
    counterpart)."""

    oracle: str
    ref: EngineRef | None = None
    forced: bool = False

    @property
    def key(self) -> str:
        return HF if self.ref is None else f"{self.oracle}:{self.ref.name}:forced={self.forced}"

    def describe(self) -> str:
        if self.ref is None:
            return "hf (transformers eager)"
        if self.forced:
            return f"eager: engine '{self.ref.name}' itself under torch.compiler.set_stance('force_eager')"
        return f"{self.oracle}: engine '{self.ref.name}'" + (
            " (its declared eager counterpart)" if self.oracle == EAGER else "")


def choose(name: str, ref: EngineRef, wanted: str, resolve) -> Choice:
    """The oracle `wanted` ('hf', 'eager' or a NAME, options.Settings.oracle) of engine `name` (`ref`);
    `resolve(NAME) -> EngineRef` (registry.resolve). A usage error names the fix."""
    if wanted == HF:
        return Choice(HF)
    if wanted == EAGER:
        counterpart = ref.declaration.eager
        if not counterpart:
            if not ref.declaration.compiled:
                raise UsageError(
                    f"--kv-oracle=eager: engine '{name}' declares neither compiled=True nor an eager counterpart, so "
                    f"its eager mode is itself and would agree with itself; give it another oracle "
                    f"(--kv-oracle={name}=hf or ={name}=NAME), or declare Declaration(compiled=True) if it compiles")
            return Choice(EAGER, ref, forced=True)
        if counterpart == name:
            raise UsageError(f"engine '{name}' declares eager='{name}', itself: declare its eager "
                             "counterpart's NAME, or nothing (its own factory under force_eager)")
        return _same_strategy(name, ref, Choice(EAGER, resolve(counterpart)))
    if wanted == name:
        raise UsageError(f"--kv-oracle: engine '{name}' cannot be its own oracle (it would agree with itself); "
                         f"use --kv-oracle={name}=eager for its eager mode, or name another engine")
    return _same_strategy(name, ref, Choice("engine", resolve(wanted)))


def _same_strategy(name: str, ref: EngineRef, choice: Choice) -> Choice:
    """A reference engine must claim the cache semantics the engine claims (its strategy), or it judges other
    semantics."""
    mine, theirs = ref.declaration.strategy, choice.ref.declaration.strategy
    if mine != theirs:
        raise UsageError(f"--kv-oracle: engine '{name}' declares strategy {mine} but its oracle "
                         f"'{choice.ref.name}' declares {theirs}: an oracle must claim the same cache semantics")
    return choice


class OracleNotEager(Failed):
    """The eager oracle ran compiled code: a failure (never a verdict by compiled-against-compiled)."""


def identity(ref: EngineRef, compile_backend: str) -> str:
    """What the reference cache is keyed by: NAME, target, the compile backend, the code of the factory's module and
    the versions of the distributions behind it, the packages it declares it requires and transformers (a changed
    engine or library is a new oracle)."""
    module_name = ref.target.partition(":")[0]
    module = sys.modules.get(module_name)
    code = ""
    if module is not None and getattr(module, "__file__", None) and Path(module.__file__).is_file():
        code = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]
    return f"{ref.name}|{ref.target}|{compile_backend}|{','.join(ref.versions())}|{code}"


class EngineOracle:
    """An engine as the oracle (module docstring): ``reference``, ``teacher_forced``, ``independent``, ``identity``."""

    def __init__(self, choice: Choice, spec: ModelSpec, compile_backend: str, tie_tolerance: float = 0.0):
        assert choice.ref is not None
        self.choice, self.spec, self.compile_backend = choice, spec, compile_backend
        self.tie_tolerance = tie_tolerance
        self.ref = dataclasses.replace(choice.ref, name=f"{choice.ref.name} (the oracle)")  # names it in failures
        self.scored = choice.ref.declaration.scoring
        self.source = choice.describe() + (", its score() for near ties" if self.scored else "")
        self.not_eager: str | None = None
        self._refused: dict[tuple, str] = {}  # (prompt, max_new_tokens) -> why the oracle engine gave no reference
        with self._watched(f"its factory {choice.ref.target}"):
            self.engine = engine_io.build(self.ref, spec, compile_backend)

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    def limitations(self) -> list[str]:
        """What this oracle cannot see, for the reports (oracles/store.py: facts)."""
        found = []
        if self.choice.forced:
            found.append("the oracle is the engine's own code in eager mode: only what compiling changes is checked "
                         "(--kv-oracle=hf checks the model's math)")
        elif self.choice.ref.declaration.compiled:
            found.append(f"the oracle engine '{self.choice.ref.name}' declares compiled=True: its compiled code is "
                         "part of the reference")
        if not self.scored:
            found.append("tokens must be equal: the oracle declares no score(), so no near tie can be judged and an "
                         "engine's score() is checked against its own generate() only")
        return found

    def identity(self) -> str:
        return f"{self.choice.oracle}|forced={self.choice.forced}|{identity(self.choice.ref, self.compile_backend)}"

    @contextmanager
    def _watched(self, what: str) -> Iterator[None]:
        """Run `what` (under force_eager when forced); an eager oracle that ran compiled code fails here."""
        if self.not_eager:
            raise OracleNotEager(self.not_eager, pytrace=False)
        stance = torch.compiler.set_stance("force_eager") if self.choice.forced else nullcontext()
        recorder = CompileRecorder()
        with stance, recorder:
            yield
        if self.choice.oracle != EAGER:
            return
        hits, _ = recorder.guards
        ran = [f"dynamo compiled {e.frame}" for e in recorder.events] + (
            [f"compiled code ran {hits} time(s) (dynamo guard hits)"] if hits else []) + [
            f"a CUDA graph was captured ({site})" for site in recorder.captures]
        if ran:
            fix = ("declare its eager counterpart (Declaration(eager='NAME')) or name one with --kv-oracle="
                   f"{self.choice.ref.name}=NAME" if self.choice.forced else
                   f"its declared eager counterpart '{self.choice.ref.name}' is not eager")
            self.not_eager = (f"the eager oracle ({self.source}) ran compiled code in {what}: {'; '.join(ran[:3])}. "
                              "Its tokens cannot judge a compiled engine (compiled against compiled proves nothing): "
                              f"{fix}")
            raise OracleNotEager(self.not_eager, pytrace=False)

    def reference(self, prompt: Sequence[int], max_new_tokens: int) -> Reference:
        prompt = tuple(int(t) for t in prompt)
        if (prompt, max_new_tokens) in self._refused:
            raise OracleUnreliable(self._refused[prompt, max_new_tokens])
        try:
            with self._watched(f"generate(<prompt of length {len(prompt)}>, max_new_tokens={max_new_tokens})"):
                tokens = tuple(engine_io.generate(self.ref, self.engine, [list(prompt)], max_new_tokens,
                                                  self.spec.vocab_size)[0])
        except OracleNotEager:
            raise
        except Failed as exc:  # it raised or broke the contract: no reference, so not judged
            self._refused[prompt, max_new_tokens] = (
                f"oracle unreliable: {self.source} gave no reference for a prompt of length {len(prompt)} on model "
                f"'{self.spec.name}': {str(exc.msg).splitlines()[0].rstrip('.')}. This prompt's token checks are not "
                "judged (no verdict on the engine)")
            raise OracleUnreliable(self._refused[prompt, max_new_tokens]) from None
        logits = self.teacher_forced(prompt, tokens) if self.scored else None
        if logits is not None:
            self._consistent(prompt, tokens, logits)
        forced = (lambda got, tol: self.teacher_forced(prompt, got, tol)) if self.scored else None
        return Reference(prompt, tokens, logits, self.source, forced)

    def teacher_forced(self, prompt: Sequence[int], tokens: Sequence[int], tie_tolerance: float = 0.0) -> torch.Tensor:
        """The oracle engine's score(prompt, tokens): logits [len(tokens), vocab] (scoring oracles only)."""
        if not self.scored:
            raise ValueError(f"{self!r} declares no score(): only equal tokens can be verified")
        with self._watched(f"score(<prompt of length {len(prompt)}>, <continuation of length {len(tokens)}>)"):
            return engine_io.score(self.ref, self.engine, self.spec.vocab_size)(list(prompt), list(tokens))

    def _consistent(self, prompt: tuple[int, ...], tokens: tuple[int, ...], logits: torch.Tensor) -> None:
        """OracleUnreliable unless each of the oracle's tokens is its score()'s argmax up to the tie tolerance."""
        for step, token in enumerate(tokens):
            row = logits[step]
            best = int(row.argmax())
            gap = float(row[best] - row[token])
            if gap > self.tie_tolerance or float(row.max() - row.min()) == 0.0:
                found = (f"{self.source} on model '{self.spec.name}' ({dtype_name(self.spec.dtype)}), prompt of length "
                         f"{len(prompt)} ...{list(prompt[-4:])}, step {step}: its generate() chose {token} but its "
                         f"score() prefers {best} by {gap:.4g} > {self.tie_tolerance:g}"
                         + (" (a constant row)" if gap == 0.0 else "") + ". Its score() does not compute what its "
                         "generate() does")
                if self.choice.forced:  # the engine's own code, eager: its score() and generate() disagree
                    fail(f"engine '{self.choice.ref.name}' in its own eager mode: {found}: score() must return "
                         "the logits of the same path as generate() (the engine contract)", pytrace=False)
                raise OracleUnreliable(f"oracle unreliable: {found}, so it cannot judge near ties; its token checks "
                                       "are skipped as not judged (no verdict on the engine): fix the oracle engine's "
                                       "score()")

    def independent(self) -> tuple[Any, str]:
        """The float64 self-check's path: this oracle engine built in float64 (its score() along the oracle's
        tokens), or (None, why there is none)."""
        declared = self.choice.ref.declaration
        if not self.scored or "float64" not in declared.dtypes:
            missing = "score()" if not self.scored else "float64 (Declaration(dtypes=(..., 'float64')))"
            return None, f"none: the oracle engine '{self.choice.ref.name}' declares no {missing}"
        if self.spec.dtype == torch.float64:
            return None, "none: the oracle already runs in float64"
        wide = EngineOracle(self.choice, dataclasses.replace(self.spec, dtype=torch.float64), self.compile_backend)
        return wide, f"the oracle engine '{self.choice.ref.name}' in float64 (its score() along the oracle's tokens)"
