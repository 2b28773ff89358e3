"""Known findings as typed data: which check, on which models and prompts, failing which way.

A `KnownFinding` names a check (the test function, exactly), its scope (`models`, `prompts`: empty means all) and the
failure it expects: a `Kind` (verdicts/failures.py) and, where one kind covers several failures, a typed narrowing
(`raised`: the exception type an engine raised; `max_gap`: a mismatch by a logit gap no larger than it, a close call;
`prompt_length` / `batched`: the failing call served a prompt of that length / was a batch). The plugin marks its
tests as strict xfails that absorb only such a failure (plugin.py: `_known_findings`), read from the exception's typed
attributes (its ``kind``, its `Failure`, the ``raised`` type name of an engine error: contract/engine_io.py), never
from its message. A finding that matches no collected test of its check, or whose tests ran and none failed its way,
is listed as stale at the end of the run.

Deprecated: the old ``(test-id glob, reason, expected-failure regex)`` triples and 4-part option lines still work,
with a DeprecationWarning; they become findings with a `glob` scope and a `legacy_pattern` matched against
``"<type>: <message>"``, the one message-text path left, for them alone (no built-in engine uses it).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from pytest_kvcompile.verdicts.failures import Failure, Kind, kind_of

#: Kinds a test's failure can have (the others are run rules: they fail the run, not a test).
TEST_KINDS = (Kind.MISMATCH, Kind.DRIFT, Kind.LENGTH, Kind.SCORE, Kind.INCONSISTENT, Kind.RECOMPILE, Kind.MEMORY,
              Kind.LATENCY, Kind.CRASH, Kind.SPECULATION, Kind.OTHER)
EVERY_CHECK = "*"  # `check` of a finding on every check of its models (an engine that cannot run a model right)
ENGINE_PARAM, MODEL_PARAM, PROMPT_PARAM = "kv_engine_name", "kv_model_name", "kv_prompt_name"  # the suites' params
LINE_FORM = "ENGINE | CHECK[MODELS/PROMPTS] | KIND[(NARROWING)] | REASON"
LINE_EXAMPLE = ("hf-dynamic-compile | test_no_recompiles_after_warmup[llama] | recompile | recompiles on every new "
                "length")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_KIND_SPEC = re.compile(r"([a-z_]+)\s*(?:\((.*)\))?", re.S)


@dataclass(frozen=True)
class KnownFinding:
    """What the suite is known to find on an engine (module docstring).

    - `check`: the test function's name, exactly (``item.originalname``: ``"test_token_identity"``), or ``"*"``
      for every check of its `models`.
    - `kind`: the failure's `Kind` (``Kind.MISMATCH``, ``Kind.RECOMPILE``, ... or its value, ``"mismatch"``).
    - `reason`: for people: what the engine does wrong, and where it is written up.
    - `models`, `prompts`: the zoo models and prompt names it covers (empty: all). Matched against the test's
      parameters (``kv_model_name``, ``kv_prompt_name``); a check without a prompt parameter (one serving several
      prompts) matches `prompts` against the failing prompt (its `Failure`).
    - `raised`: with ``Kind.OTHER``, the type name of the exception the engine raised (``"IndexError"``).
    - `max_gap`: with ``Kind.MISMATCH``, the largest oracle logit gap of the diverging step it covers (a close call
      beyond the tie tolerance, not a wrong token).
    - `prompt_length`: the failing call served a prompt of this many tokens (a token failure's batch, or its own
      prompt; an engine error's generate() call).
    - `batched`: the failing call was a batch of several prompts (True) or one prompt (False).
    - `glob`, `legacy_pattern`: deprecated (old triples and option lines only): the old test-id glob and the regex
      searched in ``"<type>: <message>"``.
    """

    check: str
    kind: Kind
    reason: str
    models: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()
    raised: str = ""
    max_gap: float | None = None
    prompt_length: int | None = None
    batched: bool | None = None
    glob: str = ""
    legacy_pattern: str = ""

    def __post_init__(self) -> None:
        example = ("e.g. KnownFinding('test_token_identity', Kind.MISMATCH, 'why', models=('llama',), "
                   "prompts=('long48',))")
        if isinstance(self.kind, str) and not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                pass
        if not isinstance(self.kind, Kind) or self.kind not in TEST_KINDS:
            raise ValueError(f"known finding kind={self.kind!r}: one of {', '.join(k.value for k in TEST_KINDS)} "
                             "(a test's failure kind, pytest_kvcompile.Kind; run rules fail the run, not a test)")
        if not isinstance(self.check, str) or not (self.check or self.glob):
            raise ValueError(f"known finding check={self.check!r}: name the check, the test function, e.g. "
                             f"check='test_token_identity' ('*': every check of its models); {example}")
        if self.check and self.check != EVERY_CHECK and (not _IDENTIFIER.fullmatch(self.check)
                                                         or not self.check.startswith("test_")):
            raise ValueError(f"known finding check={self.check!r}: the name of a test function, exactly (no glob, no "
                             "parameters: scope them with models= and prompts=), starting with 'test_', e.g. "
                             "'test_token_identity'; or '*' for every check of its models")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"known finding {self.check}: give a reason, what the engine does wrong (for people)")
        for name in ("models", "prompts"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ValueError(f"known finding {self.check}: {name}={value!r} must be a tuple of names, e.g. "
                                 f"{name}=({'llama' if name == 'models' else 'long48'!r},) (empty: all)")
        if self.raised and (self.kind is not Kind.OTHER or not isinstance(self.raised, str)
                            or not _IDENTIFIER.fullmatch(self.raised)):
            raise ValueError(f"known finding {self.check}: raised={self.raised!r} is the type name of an exception the "
                             "engine raised (e.g. raised='IndexError'), with kind=Kind.OTHER (an engine error's kind)")
        if self.max_gap is not None and (self.kind is not Kind.MISMATCH or isinstance(self.max_gap, bool)
                                         or not isinstance(self.max_gap, (int, float))
                                         or not 0 < self.max_gap < math.inf):
            raise ValueError(f"known finding {self.check}: max_gap={self.max_gap!r} is a logit gap > 0 bounding a "
                             "mismatch's (e.g. max_gap=0.01), with kind=Kind.MISMATCH")
        if self.prompt_length is not None and (type(self.prompt_length) is not int or self.prompt_length < 1):
            raise ValueError(f"known finding {self.check}: prompt_length={self.prompt_length!r} is a number of tokens "
                             ">= 1, e.g. prompt_length=1")
        if self.batched is not None and not isinstance(self.batched, bool):
            raise ValueError(f"known finding {self.check}: batched={self.batched!r} is True, False or None")
        if self.legacy_pattern:
            try:
                re.compile(self.legacy_pattern)
            except re.error as exc:
                raise ValueError(f"known finding {self.glob or self.check}: {self.legacy_pattern!r} is not a "
                                 f"regular expression ({exc})") from None

    # --- scope: which collected tests -------------------------------------------------------------------------------
    def covers_check(self, name: str, originalname: str) -> bool:
        """The test (``item.name``, ``item.originalname``) is one of its check's (parameters aside)."""
        if self.check:
            return self.check == EVERY_CHECK or originalname == self.check
        return originalname == _glob_check(self.glob) or name.startswith(_glob_check(self.glob))

    def in_scope(self, name: str, originalname: str, params: Mapping[str, Any]) -> bool:
        """The test is of its check, and its model and prompt parameters are in its scope."""
        if not self.covers_check(name, originalname):
            return False
        if self.glob and not fnmatch(name, self.glob):
            return False
        return all(not names or key not in params or str(params[key]) in names
                   for key, names in ((MODEL_PARAM, self.models), (PROMPT_PARAM, self.prompts)))

    # --- the failure ------------------------------------------------------------------------------------------------
    def matches(self, error: BaseException, params: Mapping[str, Any] | None = None) -> bool:
        """The failure `error` of a test in its scope is the one it names, by typed data alone (an exception group:
        every exception in it). `params`: the test's parameters (the scope they did not decide is read from the
        failure)."""
        leaves = _leaves(error)
        return bool(leaves) and all(self._matches(e, params or {}) for e in leaves)

    def _matches(self, error: BaseException, params: Mapping[str, Any]) -> bool:
        if self.legacy_pattern:  # deprecated: the message text (old triples and option lines only)
            return bool(re.search(self.legacy_pattern, f"{type(error).__name__}: {error}"))
        if kind_of(error) is not self.kind:
            return False
        failure = getattr(error, "failure", None)
        failure = failure if isinstance(failure, Failure) else None
        if self.raised and getattr(error, "raised", None) != self.raised:
            return False
        if self.max_gap is not None and (failure is None or failure.gap is None or failure.gap > self.max_gap):
            return False
        if self.models and MODEL_PARAM not in params and (failure is None or failure.model not in self.models):
            return False
        if self.prompts and PROMPT_PARAM not in params and (
                failure is None or not any(failure.prompt in (p, f"prompt '{p}'") for p in self.prompts)):
            return False
        if self.prompt_length is None and self.batched is None:
            return True
        lengths = _call_lengths(error, failure)
        if lengths is None:
            return False
        return ((self.prompt_length is None or self.prompt_length in lengths)
                and (self.batched is None or self.batched == (len(lengths) > 1)))

    # --- text -------------------------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """``test_token_identity[llama/long48] mismatch(max_gap=0.01)``: its option-line form, less the reason."""
        if self.legacy_pattern:
            return f"'{self.glob or self.check}' (expecting /{self.legacy_pattern}/)"
        scope = ""
        if self.models or self.prompts:
            scope = f"[{','.join(self.models) or '*'}" + (f"/{','.join(self.prompts)}" if self.prompts else "") + "]"
        narrowing = [f"{name}={value}" for name, value in (("raised", self.raised), ("max_gap", self.max_gap),
                                                           ("prompt_length", self.prompt_length),
                                                           ("batched", self.batched))
                     if value not in ("", None)]
        return f"{self.check}{scope} {self.kind.value}" + (f"({', '.join(narrowing)})" if narrowing else "")

    @classmethod
    def from_triple(cls, finding: Any, stacklevel: int = 2) -> KnownFinding:
        """A deprecated ``(test-id glob, reason, expected-failure regex)`` triple, with a DeprecationWarning."""
        if not (isinstance(finding, tuple) and len(finding) == 3 and all(isinstance(x, str) and x for x in finding)):
            raise ValueError(f"known finding {finding!r}: write KnownFinding(check, kind, reason, models=..., "
                             "prompts=...) (pytest_kvcompile.KnownFinding), e.g. KnownFinding("
                             "'test_no_recompiles_after_warmup', Kind.RECOMPILE, 'recompiles per length')")
        glob, reason, pattern = finding
        warnings.warn(f"known finding {finding!r}: (test-id glob, reason, expected-failure regex) triples are "
                      "deprecated: write KnownFinding(check, kind, reason, models=..., prompts=...) "
                      "(pytest_kvcompile.KnownFinding), which matches the failure by its typed kind, not its message",
                      DeprecationWarning, stacklevel=stacklevel + 1)
        return cls._legacy(glob, reason, pattern)

    @classmethod
    def _legacy(cls, glob: str, reason: str, pattern: str) -> KnownFinding:
        exact = re.fullmatch(r"(test_\w+)(?:\[.*)?", glob)  # a bare name, or a name and its parameters
        return cls(exact.group(1) if exact else "", Kind.OTHER, reason, glob=glob, legacy_pattern=pattern)

    @classmethod
    def from_line(cls, scope: str, kind: str, reason: str) -> KnownFinding:
        """The parts of an option line ``CHECK[MODELS/PROMPTS] | KIND[(NARROWING)] | REASON`` (module docstring of
        config/options.py: `KNOWN_FINDING`); ValueError naming the fix."""
        found = re.fullmatch(r"\s*([^\[\]\s]+)\s*(?:\[([^\]]*)\])?\s*", scope)
        if not found:
            raise ValueError(f"CHECK {scope!r}: write the test function's name, then optionally [MODELS] or "
                             "[MODELS/PROMPTS], comma-separated ('*': all), e.g. test_token_identity[llama/long48]")
        check, within = found.group(1), found.group(2) or ""
        model_part, _, prompt_part = within.partition("/")  # model names hold no '/'; prompt names may
        models = tuple(m.strip() for m in model_part.split(",") if m.strip() and m.strip() != "*")
        prompts = tuple(p.strip() for p in prompt_part.split(",") if p.strip() and p.strip() != "*")
        spec = _KIND_SPEC.fullmatch(kind.strip())
        if not spec:
            raise ValueError(f"KIND {kind!r}: one of {', '.join(k.value for k in TEST_KINDS)}, optionally narrowed, "
                             "e.g. other(raised=IndexError), mismatch(max_gap=0.01), mismatch(prompt_length=1, "
                             "batched=true)")
        narrowing: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in (spec.group(2) or "").split(","))):
            key, eq, text = (x.strip() for x in item.partition("="))
            if not eq or key not in NARROWING:
                raise ValueError(f"KIND {kind!r}: {item!r} is not a narrowing; write KEY=VALUE with KEY one of "
                                 f"{', '.join(NARROWING)}, e.g. other(raised=IndexError)")
            narrowing[key] = NARROWING[key](text)
        try:
            kind_value = Kind(spec.group(1))
        except ValueError:
            raise ValueError(f"KIND {spec.group(1)!r}: one of {', '.join(k.value for k in TEST_KINDS)}") from None
        return cls(check, kind_value, reason, models=models, prompts=prompts, **narrowing)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number, e.g. max_gap=0.01") from None


def _length(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a whole number of tokens, e.g. prompt_length=1")
    return int(text)


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{text!r}: write batched=true or batched=false")
    return text.lower() == "true"


NARROWING = {"raised": str, "max_gap": _number, "prompt_length": _length, "batched": _flag}


def _glob_check(glob: str) -> str:
    """The check a deprecated glob names: its text before the first glob character (today's rule)."""
    return re.split(r"[\[*?]", glob, maxsplit=1)[0]


def _leaves(error: BaseException) -> list[BaseException]:
    inner = getattr(error, "exceptions", None)  # an exception group (hypothesis: several distinct failures)
    if isinstance(inner, tuple) and inner and all(isinstance(e, BaseException) for e in inner):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


def _call_lengths(error: BaseException, failure: Failure | None) -> tuple[int, ...] | None:
    """The prompt lengths of the failing call: a token failure's batch (its Where) or its own prompt, an engine
    error's generate() call (``lengths``); None: the failure does not say."""
    if failure is not None:
        return failure.where.lengths or (failure.prompt_length,)
    lengths = getattr(error, "lengths", None)
    return tuple(lengths) if isinstance(lengths, tuple) and lengths else None


def coerce_findings(findings: Any) -> tuple[KnownFinding, ...]:
    """`Declaration.known_findings` as KnownFindings: deprecated triples converted (DeprecationWarning); anything
    else a ValueError naming the fix."""
    if not isinstance(findings, (tuple, list)):
        raise ValueError(f"known_findings={findings!r}: a tuple of KnownFinding(check, kind, reason, ...) "
                         "(pytest_kvcompile.KnownFinding)")
    # stacklevel: from_triple <- coerce_findings <- Declaration.__post_init__ <- __init__ <- the declaring module
    return tuple(f if isinstance(f, KnownFinding) else KnownFinding.from_triple(f, stacklevel=4) for f in findings)


def legacy_line(glob: str, reason: str, pattern: str) -> KnownFinding:
    """A deprecated option line ``ENGINE | TEST-GLOB | REASON | EXPECTED`` (the caller warns)."""
    return KnownFinding._legacy(glob, reason, pattern)
