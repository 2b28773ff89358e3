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
  is dropped or the process exits: engines/server_process.py). Managed recipes: engines/vllm_server.py,
  engines/llamacpp_server.py.
- A deployed server: an API key from the environment, https verified against the system's or a given CA bundle, a
  cap on requests at once and per second (engines/server_access.py; docs/servers.md).

The wire formats are engines/server_wire.py; this module is the HTTP client. Standard library only (urllib, json,
threads): no client package is needed to check a server.
"""


from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from pytest_kvcompile.contract.engine import Declaration, ModelSpec
from pytest_kvcompile.engines.server_access import (
    CA_VARIABLE,
    KEY_VARIABLES,
    NO_LIMITS,
    Limits,
    Pace,
    api_key,
    redact,
)
from pytest_kvcompile.engines.server_wire import API, APIS, TOP_K, Answer, Malformed, Served
from pytest_kvcompile.errors import EngineFailed
from pytest_kvcompile.verdicts.failures import Kind

REQUEST_TIMEOUT_S = 120.0  # one request, unless the URL says ?timeout=SECONDS
ANSWER_SHOWN = 600  # characters of a body quoted in a failure


class ServerError(EngineFailed):
    """A request to a server engine failed; str(exc) is the whole failure (the server, the request, what to try), any
    API key redacted. `gone`: the server is (unreachable, dropped the connection, timed out), a crash; else it answered
    out of its API's format or with an error, another failure of the engine."""

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(redact(message))
        self.kind = Kind.CRASH if gone else Kind.OTHER
        self.gone = gone



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
                 who: str = "", limits: Limits = NO_LIMITS, ca_bundle: str | None = None) -> None:
        self.spec, self.api, self.url = spec, API[api], url.rstrip("/")
        self.timeout, self.top = timeout, min(top, spec.vocab_size)
        self.who = who or f"the {api} server at {self.url}"
        self.key, self.key_variable = api_key(api)
        self.limits, self._pace = limits, Pace(limits, self.url)
        self.ca_bundle = ca_bundle or os.environ.get(CA_VARIABLE) or None
        self._tls = ssl.create_default_context(cafile=self.ca_bundle) if self.url.startswith("https:") else None
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
        except (Malformed, KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._malformed(what, data, exc) from None
        if rows is None:  # its API answers without them
            return None
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
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET",
                                         headers=headers)
        at = f"{self.who}: {what} ({request.method} {path})"
        try:
            with self._pace.request(), urllib.request.urlopen(request, timeout=self.timeout,
                                                              context=self._tls) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:ANSWER_SHOWN]
            raise ServerError(f"{at} answered HTTP {exc.code} {exc.reason}: {body or '(empty body)'}"
                              f"{self._refused(exc.code)}{self.log_tail()}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLCertVerificationError):
                self.dead = (f"{at}: its TLS certificate does not verify ({exc.reason.verify_message or exc.reason}) "
                             f"against {self.ca_bundle or 'the system certificates'}")
                raise ServerError(f"{self.dead}: give the CA bundle that signed it, ?ca_bundle=PATH in the engine's "
                                  f"URL or {CA_VARIABLE}=PATH (certificates are always verified)", gone=True) from None
            raise self._unreachable(at, exc) from None
        except TimeoutError:
            self.dead = f"{at} did not answer within {self.timeout:g} s"
            raise ServerError(f"{self.dead}: the server is hung or overloaded (raise the limit with ?timeout=SECONDS "
                              f"in the engine's URL){self.log_tail()}", gone=True) from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            raise self._unreachable(at, exc) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{at} answered something that is not JSON: {raw[:ANSWER_SHOWN]!r}"
                              f"{self.log_tail()}") from None

    def _refused(self, code: int) -> str:
        """What to try after HTTP 401/403: the key to set, or that the key set was refused (never the key)."""
        if code not in (401, 403):
            return ""
        variables = " or ".join(KEY_VARIABLES[self.api.name])
        if self.key is None:
            return (f"\n  the server requires an API key and none was sent: set {variables} in the environment "
                    "(sent as 'Authorization: Bearer ...'; never on the command line, where test ids and reports "
                    "would show it)")
        return (f"\n  the server refused the API key in ${self.key_variable} (sent as 'Authorization: Bearer ...'): "
                "check that it is the key the server was started with")

    def _unreachable(self, at: str, exc: BaseException) -> ServerError:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            self.dead = f"{at} did not answer within {self.timeout:g} s"
            return ServerError(self.dead + self.log_tail(), gone=True)
        self.dead = f"{at}: the server is not reachable ({type(reason).__name__}: {reason})"
        return ServerError(f"{self.dead}: {self.not_reachable()}{self.log_tail()}", gone=True)

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


def external(api: str, url: str, timeout: float, top: int, limits: Limits = NO_LIMITS,
             ca_bundle: str | None = None) -> Callable[[ModelSpec], ServerEngine]:
    """The factory of an engine at a server the user runs (``--kv-engine=API+URL``, contract/registry.py), with the
    load allowed on it and the CA bundle its certificate is verified with (the URL's query)."""

    def factory(spec: ModelSpec) -> ServerEngine:
        return ServerEngine(spec, api, url, timeout, top, who=f"the {api} server at {url}", limits=limits,
                            ca_bundle=ca_bundle)

    factory.kv_declaration = Declaration(  # type: ignore[attr-defined]
        batching=True, isolated=False, thread_safe=True,
        description=f"a {api} server at {url} (external: {API[api].doc}; docs/servers.md)")
    return factory



__all__ = ["API", "APIS", "Answer", "KEY_VARIABLES", "Limits", "Served", "ServerEngine", "ServerError", "api_key",
           "external", "free_port", "redact"]
