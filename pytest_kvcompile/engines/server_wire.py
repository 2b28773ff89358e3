"""The wire formats of the server APIs a server engine speaks (engines/server.py): how a greedy completion of token
ids is asked and read, how a server describes the model it serves, and its teacher-forced prompt log-probabilities.
`API` maps each name of `APIS` to its format. No I/O here: the client (engines/server.py) sends what these build and
hands back what it received; an answer without the fields of its API raises `Malformed` naming them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

APIS = ("openai", "sglang", "llamacpp")
TOP_K = 20  # log-probabilities asked per step (vLLM's default --max-logprobs is 20)


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

    def rows(self, data: Any, start: int, count: int) -> list[dict[int, float]] | None:
        """The top-k log-probabilities of `count` positions from `start` in a `teacher_forced` answer; None where the
        server answered without them (it does not implement them)."""
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
        if not isinstance(found, list):  # the server does not implement vLLM's prompt_logprobs
            return None
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
