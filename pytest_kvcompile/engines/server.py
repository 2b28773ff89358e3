"""Engines that are servers: greedy token ids in and out over HTTP, checked like any engine (docs/servers.md).

Three wire formats (`API`), each with token-id prompts, greedy (temperature 0), exactly ``max_new_tokens`` tokens
(``ignore_eos``) and the server's own top-k log-probabilities of every generated step:

- ``openai``: the OpenAI-compatible completions API, ``POST /v1/completions`` with ``prompt`` a list of ids,
  ``max_tokens``, ``logprobs=k``, ``return_token_ids`` and ``return_tokens_as_token_ids`` (vLLM's extensions; a server
  without them answers token ids in ``choices[0].token_ids`` or as ``"token_id:N"`` strings, else it cannot be read),
  and ``prompt_logprobs=k`` where the server has it (vLLM), which gives the teacher-forced check (`teacher_forced`).
  vLLM, trtllm-serve, SGLang's OpenAI endpoint.
- ``sglang``: SGLang's native ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``,
  ``temperature``, ``ignore_eos``), ``return_logprob``, ``top_logprobs_num`` and ``logprob_start_len`` (``-1``: the
  output only; the prompt's length: teacher-forced rows), read from ``output_ids`` and ``meta_info``.
- ``llamacpp``: llama.cpp's ``POST /completion`` with ``prompt`` a list of ids, ``n_predict``, ``n_probs``,
  ``cache_prompt`` and ``return_tokens``, read from ``tokens`` and ``completion_probabilities``. It has no prompt
  log-probabilities: the teacher-forced check is a named skip.

Rules:

- ``generate(prompts, n)`` sends one request per prompt, all at once (threads): the server batches them as it batches
  its users' requests. Every request has a bounded timeout (`ServerEngine.timeout`); a failure (not reachable, an HTTP
  error with its body, a timeout, a connection dropped, an answer without the API's fields) raises `ServerError`
  naming the server, the call number and the request (prompt length, position in the call), never a traceback of
  ours. A server that cannot be reached or did not answer in time marks the engine `dead`: the next test builds it
  anew (a managed server is restarted), as for an isolated engine whose process died.
- The server's top-k log-probabilities of each generated step are kept per (prompt, tokens) (`top_logprobs`): the
  token check uses them to narrow the near-tie rule (oracles/token_match.py: a flip is a near tie only if the
  server's own top-k has the oracle's choice within the same allowance), never to widen it.
- Servers compute log-probabilities, not logits: they have no ``score()`` (``scoring=False``); `teacher_forced` gives
  the server's top-k log-probabilities along given tokens, which the harness compares with the oracle's
  (token_match.check_logprobs).
- Two ways to get one: `external` (``--kv-engine=API+http://HOST:PORT``, contract/registry.py parses it: the server
  is the user's, serving the run's one checkpoint) and `ManagedServer` (the engine starts the server on the checkpoint
  on a free 127.0.0.1 port, waits until it answers within `READY_TIMEOUT_S`, keeps its log, stops it when the engine
  is dropped or the process exits). Managed recipes: engines/vllm_server.py, engines/llamacpp_server.py.

Standard library only (urllib, json, threads): no client package is needed to check a server.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_kvcompile.contract.engine import Declaration, ModelSpec
from pytest_kvcompile.errors import EngineProcessDied

APIS = ("openai", "sglang", "llamacpp")
TOP_K = 20  # log-probabilities asked per step (vLLM's default --max-logprobs is 20)
REQUEST_TIMEOUT_S = 120.0  # one request, unless the URL says ?timeout=SECONDS
READY_TIMEOUT_S = 600.0  # a managed server's start (vLLM on CPU compiles first)
LOG_TAIL_LINES = 20
ANSWER_SHOWN = 600  # characters of a body quoted in a failure


class ServerError(EngineProcessDied):
    """A request to a server engine failed; str(exc) is the whole failure (the server, the request, what to try).
    `kind`: "crash" where the server is gone (unreachable, dropped the connection, timed out), else "other"."""

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.kind = "crash" if gone else "other"
        self.gone = gone


@dataclass(frozen=True)
class Answer:
    """One completion: the generated ids, the server's top-k log-probabilities per step (None: not given), and the
    prompt tokens it says it served from its prefix cache (None: it does not say)."""

    tokens: list[int]
    top: list[dict[int, float]] | None = None
    cached: int | None = None


@dataclass(frozen=True)
class Served:
    """What a server says about the model it serves (None: it does not say)."""

    path: str | None = None
    name: str | None = None
    vocab: int | None = None
    hidden: int | None = None
    positions: int | None = None  # the longest sequence it serves

    def describe(self) -> str:
        facts = [f"{k}={v}" for k, v in (("path", self.path), ("name", self.name), ("vocab", self.vocab),
                                         ("hidden", self.hidden), ("positions", self.positions)) if v is not None]
        return ", ".join(facts) or "nothing (no endpoint of its API describes the model)"


class Malformed(ValueError):
    """An answer without the fields of its API (the message says which)."""


def _ids(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise Malformed(f"{what} is not a list of token ids: {str(values)[:200]}")
    return values


def _token_id(key: Any) -> int:
    """An id written as an int, "17" or vLLM's "token_id:17"."""
    text = str(key)
    return int(text.removeprefix("token_id:"))


class Api:
    """One wire format: its requests and how its answers are read."""

    name = ""
    ready = "/health"  # GET: 200 once the server serves
    doc = ""

    def completion(self, model: str | None, prompt: list[int], n: int, top: int) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def answer(self, data: Any) -> Answer:
        raise NotImplementedError

    def teacher_forced(self, model: str | None, ids: list[int], start: int, top: int) -> tuple[str, dict] | None:
        """The request whose answer gives the top-k log-probabilities of positions start.. of `ids`; None: the API
        has none."""
        return None

    def rows(self, data: Any, start: int, count: int) -> list[dict[int, float]]:
        raise NotImplementedError

    def served(self, get: Callable[[str], Any]) -> tuple[Served, str | None]:
        """What the server says about its model, and the model name requests must carry (OpenAI) or None."""
        return Served(), None


class OpenAI(Api):
    name, ready = "openai", "/v1/models"
    doc = "POST /v1/completions (OpenAI-compatible, token-id prompt)"

    def completion(self, model, prompt, n, top):
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                   "ignore_eos": True, "logprobs": top, "return_token_ids": True,
                                   "return_tokens_as_token_ids": True, "stream": False}

    def answer(self, data):
        choice = self._choice(data)
        logprobs = choice.get("logprobs") or {}
        if choice.get("token_ids") is not None:
            tokens = _ids(choice["token_ids"], "choices[0].token_ids")
        elif logprobs.get("tokens") and all(str(t).startswith("token_id:") for t in logprobs["tokens"]):
            tokens = [_token_id(t) for t in logprobs["tokens"]]
        else:
            raise Malformed("choices[0] has no token_ids and its logprobs.tokens are text, not 'token_id:N' (the "
                            "server does not return token ids: vLLM needs return_token_ids or "
                            "return_tokens_as_token_ids)")
        top = None
        rows = logprobs.get("top_logprobs")
        if isinstance(rows, list) and len(rows) == len(tokens):
            try:
                top = [{_token_id(k): float(v) for k, v in (row or {}).items()} for row in rows]
            except (ValueError, AttributeError):  # text tokens: ids cannot be told
                top = None
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Answer(tokens, top, cached if isinstance(cached, int) else None)

    def teacher_forced(self, model, ids, start, top):
        return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                   "ignore_eos": True, "prompt_logprobs": top, "stream": False}

    def rows(self, data, start, count):
        found = self._choice(data).get("prompt_logprobs")
        if not isinstance(found, list):
            raise NotImplementedError("its answer has no choices[0].prompt_logprobs (the server does not implement "
                                      "vLLM's prompt_logprobs)")
        return [{_token_id(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in (row or {}).items()}
                for row in found[start:start + count]]

    def served(self, get):
        data = get("/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            raise Malformed("GET /v1/models lists no model")
        first = models[0]
        positions = first.get("max_model_len")
        return Served(path=first.get("root"), name=first.get("id"),
                      positions=positions if isinstance(positions, int) else None), first.get("id")

    @staticmethod
    def _choice(data):
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise Malformed("the answer has no choices[0]")
        return choices[0]


class SGLang(Api):
    name = "sglang"
    doc = "POST /generate (SGLang native, input_ids)"

    def completion(self, model, prompt, n, top):
        return "/generate", {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": top,
                             "logprob_start_len": -1,
                             "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}

    def answer(self, data):
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
            raise Malformed("the answer has no meta_info")
        meta = data["meta_info"]
        if data.get("output_ids") is not None:
            tokens = _ids(data["output_ids"], "output_ids")
        else:
            tokens = [int(entry[1]) for entry in meta.get("output_token_logprobs") or []]
        rows = meta.get("output_top_logprobs")
        top = ([{int(entry[1]): float(entry[0]) for entry in row or []} for row in rows]
               if isinstance(rows, list) and len(rows) == len(tokens) else None)
        cached = meta.get("cached_tokens")
        return Answer(tokens, top, cached if isinstance(cached, int) else None)

    def teacher_forced(self, model, ids, start, top):
        return "/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": top,
                             "logprob_start_len": start,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}

    def rows(self, data, start, count):
        meta = data.get("meta_info") if isinstance(data, dict) else None
        tops, tokens = (meta or {}).get("input_top_logprobs"), (meta or {}).get("input_token_logprobs")
        if not isinstance(tops, list) or not isinstance(tokens, list):
            raise Malformed("meta_info has no input_top_logprobs / input_token_logprobs")
        found = []
        for row, own in list(zip(tops, tokens))[:count]:
            entries = {int(e[1]): float(e[0]) for e in row or [] if e[0] is not None}
            if own and own[0] is not None:  # the position's own token, top-k or not
                entries.setdefault(int(own[1]), float(own[0]))
            found.append(entries)
        return found

    def served(self, get):
        data = get("/get_model_info")
        return Served(path=data.get("model_path") if isinstance(data, dict) else None), None


class LlamaCpp(Api):
    name = "llamacpp"
    doc = "POST /completion (llama.cpp's server, token-array prompt)"

    def completion(self, model, prompt, n, top):
        return "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                               "n_probs": top, "cache_prompt": True, "return_tokens": True, "stream": False}

    def answer(self, data):
        if not isinstance(data, dict) or "tokens" not in data:
            raise Malformed("the answer has no tokens (llama.cpp fills them with return_tokens)")
        tokens = _ids(data["tokens"], "tokens")
        rows = data.get("completion_probabilities")
        top = None
        if isinstance(rows, list) and len(rows) == len(tokens):
            top = [{int(e["id"]): float(e["logprob"]) for e in row.get("top_logprobs") or []} for row in rows]
        cached = data.get("tokens_cached")
        return Answer(tokens, top, cached if isinstance(cached, int) else None)

    def served(self, get):
        props = get("/props")
        models = get("/v1/models")
        meta = ((models.get("data") or [{}])[0].get("meta") or {}) if isinstance(models, dict) else {}
        settings = props.get("default_generation_settings") or {} if isinstance(props, dict) else {}
        return Served(path=props.get("model_path") if isinstance(props, dict) else None, vocab=meta.get("n_vocab"),
                      hidden=meta.get("n_embd"), positions=meta.get("n_ctx_train") or settings.get("n_ctx")), None


API = {api.name: api for api in (OpenAI(), SGLang(), LlamaCpp())}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (asked of the kernel; the server binds it just after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerEngine:
    """The engine contract over a server's HTTP API: see the module docstring."""

    kv_declaration = Declaration(batching=True, isolated=False, thread_safe=True,
                                 description="a server over HTTP (docs/servers.md)")

    def __init__(self, spec: ModelSpec, api: str, url: str, timeout: float = REQUEST_TIMEOUT_S, top: int = TOP_K,
                 who: str = "") -> None:
        self.spec, self.api, self.url = spec, API[api], url.rstrip("/")
        self.timeout, self.top = timeout, min(top, spec.vocab_size)
        self.who = who or f"the {api} server at {self.url}"
        self.calls = 0
        self.dead: str | None = None
        self._top: dict[tuple[tuple[int, ...], tuple[int, ...]], list[dict[int, float]] | None] = {}
        self._lock = threading.Lock()
        self.served, self.model = self._describe()
        self._check_config()

    # --- the contract ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        with self._lock:
            self.calls += 1
            call = self.calls
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        lengths = [len(p) for p in prompts]
        answers: list[Any] = [None] * len(prompts)

        def one(i: int) -> None:
            together = f", sent together with prompts of lengths {lengths}" if len(prompts) > 1 else ""
            what = (f"call {call}, request {i + 1} of {len(prompts)} (prompt of length {lengths[i]}, "
                    f"{max_new_tokens} new tokens{together})")
            try:
                path, body = self.api.completion(self.model, list(prompts[i]), max_new_tokens, self.top)
                answers[i] = self._read(self.api.answer, self.post(path, body, what), what)
            except ServerError as exc:
                answers[i] = exc

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout + 5  # each request has its own timeout; this bounds a stuck thread
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        failed = next((a for a in answers if isinstance(a, ServerError)), None)
        if failed is not None:
            raise failed
        if any(a is None for a in answers):
            self.dead = f"{self.who}: call {call} did not finish within {self.timeout:g} s"
            raise ServerError(self.dead + self.log_tail(), gone=True)
        out = []
        for prompt, answer in zip(prompts, answers):
            with self._lock:
                self._top[(tuple(prompt), tuple(answer.tokens))] = answer.top
            out.append(list(answer.tokens))
        return out

    # --- what the harness reads besides tokens ---------------------------------------------------------------------
    def top_logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[dict[int, float]] | None:
        """The server's top-k log-probabilities of each step of the answer `tokens` it gave for `prompt` (None: it
        gave none, or never gave these tokens for this prompt)."""
        with self._lock:
            return self._top.get((tuple(int(t) for t in prompt), tuple(int(t) for t in tokens)))

    def teacher_forced(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[dict[int, float]] | None:
        """The server's top-k log-probabilities at each step of `tokens` after `prompt`, teacher-forced (its prompt
        log-probabilities of prompt + tokens); None where its API has none."""
        ids = [int(t) for t in (*prompt, *tokens)]
        request = self.api.teacher_forced(self.model, ids, len(prompt), self.top)
        if request is None or not tokens:
            return None
        with self._lock:
            self.calls += 1
            what = f"call {self.calls}, prompt log-probabilities of a prompt of length {len(prompt)} + {len(tokens)}"
        data = self.post(*request, what)
        try:
            rows = self.api.rows(data, len(prompt), len(tokens))
        except NotImplementedError:
            return None
        except (Malformed, KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._malformed(what, data, exc) from None
        if len(rows) != len(tokens):
            raise ServerError(f"{self.who}: {what}: it gave log-probabilities for {len(rows)} positions, expected "
                              f"{len(tokens)}{self.log_tail()}")
        return rows

    # --- HTTP ----------------------------------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], what: str) -> Any:
        return self._request(path, json.dumps(body).encode(), what)

    def get(self, path: str, what: str = "") -> Any:
        return self._request(path, None, what or f"GET {path}")

    def _request(self, path: str, data: bytes | None, what: str) -> Any:
        if self.dead:
            raise ServerError(f"{self.dead}; not sent: {what}", gone=True)
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET",
                                         headers={"Content-Type": "application/json"})
        at = f"{self.who}: {what} ({request.method} {path})"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:ANSWER_SHOWN]
            raise ServerError(f"{at} answered HTTP {exc.code} {exc.reason}: {body or '(empty body)'}"
                              f"{self.log_tail()}") from None
        except TimeoutError:
            self.dead = f"{at} did not answer within {self.timeout:g} s"
            raise ServerError(f"{self.dead}: the server is hung or overloaded (raise the limit with ?timeout=SECONDS "
                              f"in the engine's URL){self.log_tail()}", gone=True) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                self.dead = f"{at} did not answer within {self.timeout:g} s"
                raise ServerError(self.dead + self.log_tail(), gone=True) from None
            self.dead = f"{at}: the server is not reachable ({type(reason).__name__}: {reason})"
            raise ServerError(f"{self.dead}: {self.not_reachable()}{self.log_tail()}", gone=True) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{at} answered something that is not JSON: {raw[:ANSWER_SHOWN]!r}"
                              f"{self.log_tail()}") from None

    def _read(self, parse: Callable[[Any], Any], data: Any, what: str) -> Any:
        try:
            return parse(data)
        except (Malformed, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise self._malformed(what, data, exc) from None

    def _malformed(self, what: str, data: Any, exc: Exception) -> ServerError:
        return ServerError(f"{self.who}: {what}: its answer is not {self.api.doc}'s format ({exc}): "
                           f"{json.dumps(data)[:ANSWER_SHOWN]}")

    def not_reachable(self) -> str:
        """What to try when the server cannot be reached (a managed server says what its process did)."""
        return "is it running and listening there? (check the URL given to --kv-engine)"

    def log_tail(self) -> str:
        """The end of the server's log (managed servers), for failure messages."""
        return ""

    def close(self) -> None:
        """Stop what this engine started (a managed server); a server the user runs is left alone."""

    # --- the served model ----------------------------------------------------------------------------------------
    def _describe(self) -> tuple[Served, str | None]:
        try:
            return self.api.served(lambda path: self.get(path, "asking which model it serves"))
        except (Malformed, KeyError, TypeError, AttributeError) as exc:
            raise ServerError(f"{self.who}: asking which model it serves: the answer is not {self.api.doc}'s "
                              f"format ({exc}){self.log_tail()}") from None

    def _check_config(self) -> None:
        """The config the server exposes against the checkpoint's; a difference means another model is served."""
        config, served = self.spec.config, self.served
        from pytest_kvcompile.models.checkpoints import max_positions

        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        limit = max_positions(config)
        wrong = [f"{what} {got} (the checkpoint's {want})" for what, got, want in (
            ("a vocabulary of", served.vocab, self.spec.vocab_size), ("a hidden size of", served.hidden, hidden))
            if got is not None and want is not None and int(got) != int(want)]
        if served.positions is not None and limit is not None and served.positions > limit:
            wrong.append(f"{served.positions} positions (the checkpoint has {limit})")
        if wrong:
            raise ServerError(
                f"{self.who} serves another model than '{self.spec.name}' ({self.spec.path}): it says it has "
                f"{', '.join(wrong)}; it describes its model as: {served.describe()}. Start the server on that "
                f"checkpoint, or give the checkpoint it serves with --kv-model=PATH")


def external(api: str, url: str, timeout: float, top: int) -> Callable[[ModelSpec], ServerEngine]:
    """The factory of an engine at a server the user runs (``--kv-engine=API+URL``, contract/registry.py)."""

    def factory(spec: ModelSpec) -> ServerEngine:
        return ServerEngine(spec, api, url, timeout, top, who=f"the {api} server at {url}")

    factory.kv_declaration = Declaration(  # type: ignore[attr-defined]
        batching=True, isolated=False, thread_safe=True,
        description=f"a {api} server at {url} (external: {API[api].doc}; docs/servers.md)")
    return factory


# --- managed servers -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """How a managed server starts: its command (with the port), extra environment, and the API it speaks."""

    command: list[str]
    api: str
    env: dict[str, str]
    ready_timeout: float = READY_TIMEOUT_S


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server started by this process: its log file, readiness, and a stop that always happens."""

    def __init__(self, launch: Launch, name: str) -> None:
        self.name, self.launch = name, launch
        folder = Path(tempfile.mkdtemp(prefix=f"kvcompile-server-{name}-"))
        self.log_path = folder / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(launch.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **launch.env}, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._finalizer = weakref.finalize(self, _stop, self.proc)  # also runs at exit (finalize.atexit)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        self._finalizer()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"\n  (its log {self.log_path} cannot be read)"
        shown = "\n".join("    " + line for line in text) or "    (empty)"
        return f"\n  server log {self.log_path} (last {len(text)} lines):\n{shown}"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class ManagedServer(ServerEngine):
    """A server this engine starts on the checkpoint (subclasses say how: `launch`), on a free 127.0.0.1 port; stopped
    when the engine is dropped and when the process exits. A failure names the server's log and quotes its end."""

    kv_declaration = Declaration(batching=True, isolated=False, thread_safe=True, description="a managed server")
    timeout = REQUEST_TIMEOUT_S

    def launch(self, spec: ModelSpec, port: int) -> Launch:
        raise NotImplementedError

    def __init__(self, spec: ModelSpec) -> None:
        port = free_port()
        launch = self.launch(spec, port)
        name = type(self).__name__
        self.process = ServerProcess(launch, name)
        url = f"http://127.0.0.1:{port}"
        who = f"the managed {name} server at {url} (pid {self.process.proc.pid})"
        try:
            self._wait_ready(url, API[launch.api].ready, launch.ready_timeout, who)
            super().__init__(spec, launch.api, url, self.timeout, TOP_K, who=who)
        except BaseException:
            self.process.stop()
            raise

    def _wait_ready(self, url: str, path: str, timeout: float, who: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.process.exited()
            if status is not None:
                raise ServerError(f"{who} exited (status {status}) before it answered GET {path}; command: "
                                  f"{' '.join(self.process.launch.command)}{self.process.tail()}", gone=True)
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                with urllib.request.urlopen(url + path, timeout=5) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                self.process.stop()
                raise ServerError(f"{who} did not answer GET {path} within {timeout:g} s of its start; command: "
                                  f"{' '.join(self.process.launch.command)}{self.process.tail()}", gone=True)
            time.sleep(0.25)

    def not_reachable(self) -> str:
        status = self.process.exited()
        if status is not None:
            return f"its process exited (status {status})"
        return "its process is still running but does not accept connections"

    def log_tail(self) -> str:
        return self.process.tail()

    def close(self) -> None:
        self.process.stop()


__all__ = ["API", "APIS", "Answer", "Launch", "ManagedServer", "ServerEngine", "ServerError", "ServerProcess",
           "external", "free_port"]
