"""Resolve an engine NAME to its factory.

A NAME is, in this order: (1) a built-in engine, (2) an entry point in the group
``pytest_kvcompile.engines`` of any installed package, or (3) an import path
``package.module:attr``. Anything else is a usage error that lists what exists.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, entry_points, packages_distributions, version
from pathlib import Path
from typing import Any

from pytest_kvcompile.contract.engine import (
    Declaration,
    EngineFactory,
    ModelSpec,
    declaration_of,
)
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.errors import EngineResolutionError

ENTRY_POINT_GROUP = "pytest_kvcompile.engines"

#: Built-in engines: NAME -> import path. Imported only when used.
BUILTIN_ENGINES: dict[str, str] = {
    "hf-eager": "pytest_kvcompile.engines.hf:HFEager",
    "hf-static-compile": "pytest_kvcompile.engines.hf:HFStaticCompile",
    "hf-dynamic-compile": "pytest_kvcompile.engines.hf:HFDynamicCompile",
    "hf-static-chunked-compile": "pytest_kvcompile.engines.hf:HFStaticChunkedCompile",
    "hf-assisted": "pytest_kvcompile.engines.hf:HFAssisted",
    "hf-prompt-lookup": "pytest_kvcompile.engines.hf:HFPromptLookup",
    "hf-sliding-window-cache": "pytest_kvcompile.engines.hf:HFSlidingWindowCache",
    "ref-compiled-dynamic": "reference_impls.compiled_dynamic:CompiledDynamicCache",
    "ref-chunked-prefill": "reference_impls.chunked_prefill:ChunkedPrefill",
    "ref-sliding-window": "reference_impls.sliding_window:SlidingWindowCache",
    "ref-static": "reference_impls.static_cache:StaticCache",
    "ref-static-cudagraph": "reference_impls.static_cache:StaticCacheCudaGraph",
    "ref-last-recent": "reference_impls.eviction_engine:LastRecent",
    "ref-streaming-llm": "reference_impls.eviction_engine:StreamingLLM",
    "ref-h2o": "reference_impls.eviction_engine:H2O",
    "ref-tova": "reference_impls.eviction_engine:TOVA",
    "ref-streaming-llm-shifted": "reference_impls.eviction_engine:StreamingLLMShifted",
    "ref-kv-shared": "reference_impls.kv_shared:KVSharedPrefillSkip",
    "ref-speculative": "reference_impls.speculative:SpeculativeDecoding",
    "ref-speculative-lookup": "reference_impls.speculative:SpeculativePromptLookup",
    "ref-paged-prefix": "reference_impls.paged_prefix:PagedPrefixCache",
    # Third-party engines: their packages are imported when the engine is built, never at resolve time.
    "vllm": "pytest_kvcompile.engines.vllm:VLLMEager",
    "vllm-compile": "pytest_kvcompile.engines.vllm:VLLMCompiled",
    "vllm-prefix-cache": "pytest_kvcompile.engines.vllm:VLLMPrefixCache",
    "vllm-ngram": "pytest_kvcompile.engines.vllm:VLLMNgram",
    "vllm-server": "pytest_kvcompile.engines.vllm_server:VLLMServer",
    "litgpt": "pytest_kvcompile.engines.litgpt:LitGPT",
    "litgpt-compile": "pytest_kvcompile.engines.litgpt:LitGPTCompiled",
    "litgpt-top-k-1": "pytest_kvcompile.engines.litgpt:LitGPTTopK1",
    "kvpress-streaming": "pytest_kvcompile.engines.kvpress:StreamingLLM",
    "kvpress-streaming-rerotated": "pytest_kvcompile.engines.kvpress:StreamingLLMRerotated",
    "kvpress-snapkv": "pytest_kvcompile.engines.kvpress:SnapKV",
    "kvpress-tova": "pytest_kvcompile.engines.kvpress:TOVA",
    "kvpress-knorm": "pytest_kvcompile.engines.kvpress:KNorm",
    "kvpress-decoding-knorm": "pytest_kvcompile.engines.kvpress:DecodingKnorm",
    "onnxruntime": "pytest_kvcompile.engines.onnxruntime:ORTCausalLM",
    "hf-export": "pytest_kvcompile.engines.export:HFExport",
    "executorch": "pytest_kvcompile.engines.executorch:ExecuTorch",
    "llama-cpp": "pytest_kvcompile.engines.llamacpp:LlamaCpp",
    "llama-cpp-q8-kv": "pytest_kvcompile.engines.llamacpp:LlamaCppQ8KV",
    "llama-cpp-prompt-cache": "pytest_kvcompile.engines.llamacpp:LlamaCppPromptCache",
    "llama-cpp-prompt-lookup": "pytest_kvcompile.engines.llamacpp:LlamaCppPromptLookup",
    "llama-cpp-gguf": "pytest_kvcompile.engines.llamacpp_gguf:LlamaCppGGUF",
    "llama-cpp-server": "pytest_kvcompile.engines.llamacpp_server:LlamaCppServer",
    "ctranslate2": "pytest_kvcompile.engines.ct2:CTranslate2",
    "hf-continuous-batching": "pytest_kvcompile.engines.continuous:ContinuousBatching",
    "hf-continuous-batching-prefix-cache": "pytest_kvcompile.engines.continuous:ContinuousBatchingPrefixCache",
    "openvino": "pytest_kvcompile.engines.ov:OpenVINO",
    "mistralrs": "pytest_kvcompile.engines.mistralrs:MistralRs",
    "hf-quantized-quanto": "pytest_kvcompile.engines.quantized:QuantizedQuanto",
    "hf-quantized-hqq": "pytest_kvcompile.engines.quantized:QuantizedHQQ",
    "hf-quantized-hqq-int8": "pytest_kvcompile.engines.quantized:QuantizedHQQInt8",
}


@dataclass(frozen=True)
class EngineRef:
    """A resolved engine: its NAME, where it came from, its factory and declaration."""

    name: str
    target: str
    source: str  # "built-in", "entry point of <dist>", "import path", "server URL"
    factory: EngineFactory = field(compare=False, repr=False)
    declaration: Declaration = field(compare=False)

    def build(self, spec: ModelSpec, compile_backend: str) -> Any:
        """Call the factory; one that takes a ``compile_backend`` keyword gets --kv-compile-backend."""
        if _accepts_backend(self.factory):
            return self.factory(spec, compile_backend=compile_backend)
        return self.factory(spec)

    def versions(self) -> list[str]:
        """``dist==version`` of the distributions behind this engine: the one of its factory's module, those of the
        packages it declares it requires, and transformers (what a report or a cached reference must name)."""
        tops = [self.target.partition(":")[0].split(".")[0],
                *(name.split(".")[0] for name, _ in self.declaration.requires), "transformers"]
        found = []
        for dist in dict.fromkeys(d for top in tops for d in _distributions().get(top, [])):
            try:
                found.append(f"{dist}=={version(dist)}")
            except PackageNotFoundError:
                pass
        return found


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def _accepts_backend(factory: Any) -> bool:
    try:
        return "compile_backend" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False


def _entry_points() -> dict[str, tuple[str, str]]:
    return {
        ep.name: (ep.value, f"entry point of {ep.dist.name if ep.dist else 'an installed package'}")
        for ep in entry_points(group=ENTRY_POINT_GROUP)
    }


def available() -> dict[str, tuple[str, str]]:
    """Every NAME resolvable without an import path: NAME -> (target, source)."""
    found = {name: (target, "built-in") for name, target in BUILTIN_ENGINES.items()}
    for name, value in _entry_points().items():
        found.setdefault(name, value)
    return found


#: A server the user runs, named by its API and URL:
#: ``API+http(s)://HOST:PORT[/PATH][?timeout=SECONDS&top=K&max_concurrency=N&max_rps=R&ca_bundle=PATH]``
SERVER_SOURCE = "server URL"
SERVER_TARGET = "pytest_kvcompile.engines.server:external"
SERVER_APIS = {"openai": "the OpenAI-compatible /v1/completions of vLLM, trtllm-serve, SGLang",
               "sglang": "SGLang's native /generate", "llamacpp": "llama.cpp's /completion"}
SERVER_EXAMPLE = "openai+http://127.0.0.1:8000"
SERVER_QUERY = ("?timeout=SECONDS (per request, > 0), ?top=K (log-probabilities asked per step, a whole number), "
                "?max_concurrency=N (requests in flight at once, >= 1), ?max_rps=R (requests started per second, > 0) "
                "and ?ca_bundle=PATH (the CA certificates an https server's certificate is verified with)")
#: query parameters that would put a secret on the command line (and into test ids and reports)
SECRET_PARAMETERS = ("api_key", "apikey", "key", "token", "access_token", "authorization", "password")


@dataclass(frozen=True)
class ServerURL:
    """A parsed ``API+URL`` engine NAME: the wire format, the base URL, the per-request timeout, the top-k asked, the
    load allowed on the server (None: no cap) and the CA bundle its certificate is verified with (None: the
    system's)."""

    api: str
    url: str
    timeout: float = 120.0
    top: int = 20
    max_concurrency: int | None = None
    max_rps: float | None = None
    ca_bundle: str | None = None


def is_server_url(name: str) -> bool:
    return "://" in name or (name.partition("+")[0] in SERVER_APIS and "+" in name)


def server_url(name: str) -> ServerURL:
    """Parse an ``API+URL`` engine NAME; EngineResolutionError naming the fix."""
    from urllib.parse import parse_qs, urlsplit

    apis = "; ".join(f"{api} ({what})" for api, what in SERVER_APIS.items())
    api, plus, url = name.partition("+")
    if not plus or "://" in api:
        raise EngineResolutionError(f"engine '{name}': a server is named by its API and URL, API+URL, e.g. "
                                    f"{SERVER_EXAMPLE}; the API is one of {apis}")
    if api not in SERVER_APIS:
        raise EngineResolutionError(f"engine '{name}': unknown server API '{api}'; write one of {apis} before the "
                                    f"'+', e.g. {SERVER_EXAMPLE}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.fragment:
        raise EngineResolutionError(f"engine '{name}': '{url}' is not a server URL; write http://HOST:PORT or "
                                    f"https://HOST:PORT (the server's base URL, port included), e.g. {SERVER_EXAMPLE}")
    if parts.username or parts.password:
        raise EngineResolutionError(f"engine '{api}+{parts.scheme}://{parts.hostname}:{port}': credentials in the URL "
                                    "would be shown in test ids and reports; set the API key in the environment "
                                    "instead: KVCOMPILE_API_KEY (the openai API also reads OPENAI_API_KEY)")
    found: dict[str, object] = {}
    for key, values in parse_qs(parts.query, keep_blank_values=True).items():
        text = values[-1]
        value = _number(text)
        if key.lower() in SECRET_PARAMETERS:
            raise EngineResolutionError(
                f"engine '{api}+{parts.scheme}://{parts.hostname}:{port}': query parameter '{key}' would put a secret "
                "on the command line (and into test ids and reports); set the API key in the environment instead: "
                "KVCOMPILE_API_KEY (the openai API also reads OPENAI_API_KEY), sent as 'Authorization: Bearer ...'")
        if key == "timeout" and value is not None and value > 0:
            found["timeout"] = value
        elif key == "top" and text.isdigit():
            found["top"] = int(text)
        elif key == "max_concurrency" and text.isdigit() and int(text) >= 1:
            found["max_concurrency"] = int(text)
        elif key == "max_rps" and value is not None and value > 0:
            found["max_rps"] = value
        elif key == "ca_bundle" and text:
            if not Path(text).is_file():
                raise EngineResolutionError(f"engine '{name}': ?ca_bundle={text}: no such file; give the PEM file of "
                                            "the CA certificates that signed the server's certificate")
            found["ca_bundle"] = text
        else:
            raise EngineResolutionError(f"engine '{name}': query parameter {key}={text!r} is not understood; the URL "
                                        f"takes {SERVER_QUERY}, e.g. {SERVER_EXAMPLE}?timeout=60&max_concurrency=4")
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
    return ServerURL(api, base, **found)  # type: ignore[arg-type]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def check_served_models(engines: dict[str, EngineRef], models: list[str]) -> None:
    """A server the user runs serves one checkpoint: a run with one checks exactly one model."""
    servers = [name for name, ref in engines.items() if ref.source == SERVER_SOURCE]
    if servers and len(models) != 1:
        raise EngineResolutionError(
            f"engine '{servers[0]}' is a server the run does not start: it serves one checkpoint, but the run has "
            f"{len(models)} models ({', '.join(models) or 'none'}). Give that checkpoint alone: --kv-model=PATH "
            "--kv-zoo=none (or --kv-zoo=NAME for a zoo checkpoint it serves)")


def _import_target(name: str, target: str) -> Any:
    if target == SERVER_TARGET and is_server_url(name):  # the factory of that server (engines/server.py: external)
        parsed = server_url(name)
        module = importlib.import_module(SERVER_TARGET.partition(":")[0])
        return module.external(parsed.api, parsed.url, parsed.timeout, parsed.top,
                               module.Limits(parsed.max_concurrency, parsed.max_rps), parsed.ca_bundle)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise EngineResolutionError(
            f"engine '{name}': import path '{target}' must look like 'package.module:attr'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the engine's own import error, shown with its traceback
        tb = _engine_frames(exc)
        raise EngineResolutionError(
            f"engine '{name}': importing module '{module_name}' failed "
            f"({type(exc).__name__}: {exc}).\nThe engine's traceback:\n{tb}"
            + _install_hint(exc)
        ) from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise EngineResolutionError(
            f"engine '{name}': module '{module_name}' has no attribute '{attr}'"
        ) from None
    if not callable(obj):
        raise EngineResolutionError(
            f"engine '{name}': '{target}' is a {type(obj).__name__}, not a factory; it must be a class "
            "or function taking a ModelSpec and returning an object with generate()"
        )
    return obj


def _engine_frames(exc: Exception) -> str:
    """The traceback from the first frame outside this module and importlib."""
    frames = traceback.extract_tb(exc.__traceback__)
    while frames and (frames[0].filename == __file__ or "importlib" in frames[0].filename):
        frames.pop(0)
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc))


def _install_hint(exc: Exception) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"\nHint: the package '{exc.name.split('.')[0]}' is not installed in this environment."
    return ""


def resolve(name: str) -> EngineRef:
    """Resolve one NAME; raises EngineResolutionError (a pytest.UsageError) on failure."""
    known = available()
    if name in known:
        target, source = known[name]
    elif is_server_url(name):
        server_url(name)  # a usage error naming the fix before anything is imported
        target, source = SERVER_TARGET, SERVER_SOURCE
    elif ":" in name:
        target, source = name, "import path"
    else:
        listing = ", ".join(sorted(known)) or "(none)"
        raise EngineResolutionError(
            f"unknown engine '{name}'. Available engines: {listing}. "
            "Give a built-in name, an entry point of the group "
            f"'{ENTRY_POINT_GROUP}', an import path 'package.module:attr' or a server, API+URL, e.g. "
            f"{SERVER_EXAMPLE} (pytest --kv-list-engines lists them)."
        )
    factory = _import_target(name, target)
    try:
        declaration = declaration_of(factory)
    except TypeError as exc:
        raise EngineResolutionError(f"engine '{name}': {exc}") from None
    _check_known_findings(name, declaration)
    _check_requires(name, declaration)
    return EngineRef(name, target, source, factory, declaration)


def _check_known_findings(name: str, declaration: Declaration) -> None:
    """Each declared known finding is a KnownFinding (Declaration converts the deprecated triples): it absorbs only
    the failure it names, by its typed kind and scope (contract/findings.py)."""
    for finding in declaration.known_findings:
        if not isinstance(finding, KnownFinding):
            raise EngineResolutionError(
                f"engine '{name}': known finding {finding!r} must be a KnownFinding(check, kind, reason, models=..., "
                "prompts=...) (pytest_kvcompile.KnownFinding), e.g. KnownFinding('test_no_recompiles_after_warmup', "
                "Kind.RECOMPILE, 'recompiles per length')"
            )


def importable(module: str) -> bool:
    """Whether `module` (dotted: its parents too) can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing (optimum.quanto without optimum)
        return False


def _check_requires(name: str, declaration: Declaration) -> None:
    """Usage error naming the install command when a package the engine declares is not importable."""
    missing = [(module, pip) for module, pip in declaration.requires if not importable(module)]
    if missing:
        specs = " ".join(f"'{pip}'" for _, pip in missing)
        modules = ", ".join(f"'{module}'" for module, _ in missing)
        raise EngineResolutionError(
            f"engine '{name}' needs {modules}, not installed in this environment ({sys.executable}).\n"
            f"Install it: python -m pip install {specs}\n"
            f"or check it in a virtual environment of its own: kvcompile check-engine {name}"
        )


def listing() -> list[str]:
    """One line per resolvable engine, for --kv-list-engines (import failures shown inline)."""
    lines = []
    for name, (target, source) in sorted(available().items()):
        try:
            summary = resolve(name).declaration.summary()
        except EngineResolutionError as exc:
            summary = "UNAVAILABLE: " + str(exc).splitlines()[0]
        lines.append(f"{name:<24} {summary}  [{source}: {target}]")
    return lines
