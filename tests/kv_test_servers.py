"""Twin servers for the project's own tests: small HTTP servers on 127.0.0.1 that answer in the documented formats of
OpenAI-compatible completions (vLLM's token-id extensions), SGLang's /generate and llama.cpp's /completion, from a real
model's tokens and log-probabilities (transformers, a fresh cache per request), correct or carrying one bug each.

    TwinServer(checkpoint, api="openai", bug=None).start()  ->  twin.url; twin.stop()
    python -m kv_test_servers --checkpoint PATH --api openai --port N   (a managed server: ManagedTwin)

Bugs (`BUGS`): "padding" batches concurrent requests into one left-padded batch without a mask (a row's K/V padded
wrong when batched); "prefix-race" serves a request in flight beside another with that other's cached 16-token prefix;
"echo" returns the prompt's tokens in the completion of a request in flight beside another; "slow" answers prompts of
`longer` tokens or more after `delay` s; "error" answers them HTTP 500 with a body; "die" stops listening after
`after` completions; "vocab" says its vocabulary is twice the checkpoint's; "second-best" takes the runner-up at step
2 with honest log-probabilities, "second-best-sure" the same claiming its token leads by 3, "second-best-missing" the
same without the oracle's choice in its top-k; "logprobs-off" scales its teacher-forced log-probabilities by 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import DynamicCache

from pytest_kvcompile.engines.server_process import Launch, ManagedServer
from pytest_kvcompile.models.checkpoints import max_positions, pretrained, with_cache

BUGS = ("padding", "prefix-race", "echo", "slow", "error", "die", "vocab", "second-best", "second-best-sure",
        "second-best-missing", "logprobs-off")
PREFIX = 16  # the prefix-race twin's cache block
WINDOW_S = 0.05  # the padding twin gathers requests arriving this close into one batch


class Model:
    """Greedy decoding with log-probabilities: one request (`complete`), a left-padded batch without a mask (`batch`),
    teacher-forced rows (`forced`). Calls are serialized (one model, many server threads)."""

    def __init__(self, checkpoint: Path) -> None:
        self.model = pretrained(checkpoint, torch.float32).eval()
        self.config = self.model.config
        self.lock = threading.Lock()

    @torch.inference_mode()
    def complete(self, prompt: list[int], n: int, bug: str | None = None) -> tuple[list[int], list[torch.Tensor]]:
        with self.lock:
            cache, inputs, tokens, rows = DynamicCache(config=self.config), torch.tensor([prompt]), [], []
            for step in range(n):
                row = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[0, -1].log_softmax(-1)
                rows.append(row)
                token = int(row.argmax())
                if step == 2 and bug and bug.startswith("second-best"):
                    token = int(row.topk(2).indices[1])
                tokens.append(token)
                inputs = torch.tensor([[token]])
            return tokens, rows

    @torch.inference_mode()
    def batch(self, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[torch.Tensor]]]:
        with self.lock:
            width = max(map(len, prompts))
            inputs = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
            cache, found = DynamicCache(config=self.config), [([], []) for _ in prompts]
            for _ in range(n):
                rows = self.model(input_ids=inputs, **with_cache(cache), use_cache=True).logits[:, -1].log_softmax(-1)
                for (tokens, kept), row in zip(found, rows):
                    tokens.append(int(row.argmax()))
                    kept.append(row)
                inputs = rows.argmax(-1)[:, None]
            return found

    @torch.inference_mode()
    def forced(self, ids: list[int]) -> torch.Tensor:
        """Log-probabilities [len(ids), vocab]: row i predicts ids[i] (row 0: nothing before it, left as zeros)."""
        with self.lock:
            rows = self.model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        return torch.cat([torch.zeros(1, rows.shape[-1]), rows[:-1]])


def _top(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = row.topk(min(k, row.numel()))
    return [(int(i), float(v)) for v, i in zip(values, ids)]


class TwinServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, checkpoint: Path, api: str = "openai", bug: str | None = None, port: int = 0,
                 model: Model | None = None, delay: float = 3.0, after: int = 2, longer: int = 48,
                 key: str | None = None, tls: tuple[Path, Path] | None = None) -> None:
        """`key`: the API key it requires (``Authorization: Bearer KEY``; else HTTP 401 quoting the header it got, as
        a careless server would); `tls`: (certificate, private key) files: it speaks https. `peak`: the most requests
        it had in flight at once."""
        assert api in ("openai", "sglang", "llamacpp") and (bug is None or bug in BUGS), (api, bug)
        super().__init__(("127.0.0.1", port), Handler)
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*map(str, tls))
            self.socket = context.wrap_socket(self.socket, server_side=True)
        self.scheme, self.key = "https" if tls is not None else "http", key
        self.active = self.peak = 0
        self.checkpoint, self.api, self.bug, self.delay, self.after = Path(checkpoint), api, bug, delay, after
        self.longer = longer
        self.model = model or Model(self.checkpoint)
        self.completions = 0
        self.gone = False  # "die": every later request is dropped unanswered, then the server stops listening
        self.inflight: list[list[int]] = []
        self.pending: list[tuple[list[int], int, dict]] = []
        self.state = threading.Lock()
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def start(self) -> TwinServer:
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:  # a client that gave up (timed out) is not an error here
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    # --- what a completion returns: tokens and per-step log-probability rows ----------------------------------------
    def generate(self, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        bug = self.bug
        if bug == "slow" and len(prompt) >= self.longer:
            time.sleep(self.delay)
        if bug == "padding":
            return self._batched(prompt, n)
        if bug in ("prefix-race", "echo"):
            with self.state:
                others = list(self.inflight)
                self.inflight.append(prompt)
            try:
                time.sleep(WINDOW_S)  # requests sent together overlap here
                with self.state:
                    others += [o for o in self.inflight if o is not prompt and o not in others]
                if bug == "echo":  # the bug: beside another request, the answer starts with the prompt's tokens
                    tokens, rows = self.model.complete(prompt, n)
                    return ((list(prompt) + tokens)[:n] if others else tokens), rows
                # the bug: the cache slot of the first other request in flight with a full block, not its own
                slot = next((o for o in others if len(o) >= PREFIX), prompt)
                used = slot[:PREFIX] + prompt[PREFIX:] if len(prompt) > PREFIX else prompt
                return self.model.complete(used, n)
            finally:
                with self.state:
                    self.inflight.remove(prompt)
        return self.model.complete(prompt, n, bug)

    def _batched(self, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        slot = {"done": threading.Event()}
        with self.state:
            self.pending.append((prompt, n, slot))
            leader = len(self.pending) == 1
        if leader:  # the first request of a window runs the batch of every request that arrived during it
            time.sleep(WINDOW_S)
            with self.state:
                batch, self.pending = self.pending, []
            results = self.model.batch([p for p, _, _ in batch], max(k for _, k, _ in batch))
            for (_, k, waiting), (tokens, rows) in zip(batch, results):
                waiting["result"] = (tokens[:k], rows[:k])
                waiting["done"].set()
        slot["done"].wait(60)
        return slot["result"]

    def top_rows(self, tokens: list[int], rows: list[torch.Tensor], k: int) -> list[list[tuple[int, float]]]:
        found = [_top(row, k) for row in rows]
        if self.bug in ("second-best-sure", "second-best-missing") and len(found) > 2:
            chosen = tokens[2]
            others = [(t, v) for t, v in found[2] if t != chosen]
            if self.bug == "second-best-sure":  # claims its token leads by 3
                found[2] = [(chosen, others[0][1] + 3.0), *others]
            else:  # the oracle's choice (its own runner-up here) dropped from its top-k
                found[2] = [(chosen, float(rows[2][chosen])), *others[1:]]
        return found

    def forced_rows(self, ids: list[int], start: int, k: int) -> list[list[tuple[int, float]]]:
        rows = self.model.forced(ids)
        if self.bug == "logprobs-off":
            rows = rows * 0.9
        return [[*_top(rows[i], k), (ids[i], float(rows[i][ids[i]]))] for i in range(start, len(ids))]

    def count(self) -> None:
        with self.state:
            self.completions += 1
            dying = self.bug == "die" and self.completions >= self.after
        if dying:  # once this answer is sent: later requests are dropped, then find no server
            self.gone = True
            threading.Thread(target=self.stop, daemon=True).start()


class Handler(BaseHTTPRequestHandler):
    server: TwinServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self._answered()  # before the first byte: a client that read the answer sees it out of flight
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _gone(self) -> bool:
        if self.server.gone:
            self.close_connection = True
        return self.server.gone

    def _refused(self) -> bool:
        """A key is required and this request does not carry it: HTTP 401, quoting what it got (as a careless server
        would: the client must redact it)."""
        got = self.headers.get("Authorization", "")
        if self.server.key is None or got == f"Bearer {self.server.key}":
            return False
        self._send(401, {"error": {"message": f"invalid API key: {got or '(no Authorization header)'}",
                                   "type": "Unauthorized"}})
        return True

    def handle_one_request(self) -> None:
        """A request is in flight (`peak`) from its arrival until its answer starts: inside the client's own interval
        (its slot is held from before it connects until it read the answer), so a client keeping a cap is never seen
        above it, however the threads are scheduled."""
        twin, self.in_flight = self.server, True
        with twin.state:
            twin.active += 1
            twin.peak = max(twin.peak, twin.active)
        try:
            super().handle_one_request()
        finally:
            self._answered()

    def _answered(self) -> None:
        if getattr(self, "in_flight", False):
            self.in_flight = False
            with self.server.state:
                self.server.active -= 1

    def do_GET(self) -> None:
        if self._gone() or self._refused():
            return
        twin, config = self.server, self.server.model.config
        vocab = config.vocab_size * (2 if twin.bug == "vocab" else 1)
        pages = {
            "openai": {"/v1/models": {"object": "list", "data": [{"id": "twin", "object": "model",
                                                                   "root": str(twin.checkpoint),
                                                                   "max_model_len": max_positions(config)}]}},
            "sglang": {"/health": {}, "/get_model_info": {"model_path": str(twin.checkpoint), "is_generation": True}},
            "llamacpp": {"/health": {"status": "ok"},
                         "/props": {"model_path": str(twin.checkpoint), "total_slots": 4,
                                    "default_generation_settings": {"n_ctx": 512}},
                         "/v1/models": {"object": "list", "data": [{"id": "twin", "meta": {
                             "n_vocab": vocab, "n_ctx_train": max_positions(config), "n_embd": config.hidden_size}}]}},
        }[twin.api]
        if self.path in pages:
            self._send(200, pages[self.path])
        else:
            self._send(404, {"error": f"no GET {self.path}"})

    def do_POST(self) -> None:
        if self._gone():
            return
        twin = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self._refused():
            return
        prompt = body.get("prompt") or body.get("input_ids") or []
        if twin.bug == "error" and len(prompt) >= twin.longer:
            self._send(500, {"error": {"message": "CUDA out of memory (twin): tried to allocate 2.00 GiB",
                                       "type": "InternalServerError"}})
            return
        route = {"openai": ("/v1/completions", self._openai), "sglang": ("/generate", self._sglang),
                 "llamacpp": ("/completion", self._llamacpp)}[twin.api]
        if self.path != route[0]:
            self._send(404, {"error": f"no POST {self.path}"})
            return
        route[1](body)
        twin.count()

    def _openai(self, body: dict) -> None:
        twin, ids, k = self.server, list(body["prompt"]), body.get("logprobs") or 0
        tokens, rows = twin.generate(ids, body["max_tokens"])
        top = twin.top_rows(tokens, rows, k)
        choice = {"index": 0, "text": "", "finish_reason": "length", "stop_reason": None, "token_ids": tokens,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                               "token_logprobs": [float(r[t]) for t, r in zip(tokens, rows)],
                               "top_logprobs": [{f"token_id:{t}": v for t, v in row} for row in top],
                               "text_offset": [0] * len(tokens)} if k else None}
        if body.get("prompt_logprobs"):
            forced = twin.forced_rows(ids, 1, body["prompt_logprobs"])
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": v, "rank": 1, "decoded_token": ""}
                                                   for t, v in row} for row in forced]
        self._send(200, {"id": "cmpl-twin", "object": "text_completion", "model": "twin", "choices": [choice],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}})

    def _sglang(self, body: dict) -> None:
        twin, ids, k = self.server, list(body["input_ids"]), body.get("top_logprobs_num") or 0
        start = body.get("logprob_start_len", -1)
        tokens, rows = twin.generate(ids, body["sampling_params"]["max_new_tokens"])
        meta = {"id": "twin", "finish_reason": {"type": "length"}, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens), "cached_tokens": 0,
                "output_token_logprobs": [[float(r[t]), t, None] for t, r in zip(tokens, rows)],
                "output_top_logprobs": [[[v, t, None] for t, v in row] for row in twin.top_rows(tokens, rows, k)]}
        if start is not None and start >= 0:
            forced = twin.forced_rows(ids, max(start, 1), k)
            meta["input_token_logprobs"] = ([[None, ids[0], None]] if start == 0 else []) + [
                [row[-1][1], ids[i], None] for i, row in zip(range(max(start, 1), len(ids)), forced)]
            meta["input_top_logprobs"] = ([None] if start == 0 else []) + [[[v, t, None] for t, v in row[:-1]]
                                                                           for row in forced]
        self._send(200, {"text": "", "output_ids": tokens, "meta_info": meta})

    def _llamacpp(self, body: dict) -> None:
        twin, ids, k = self.server, list(body["prompt"]), body.get("n_probs") or 0
        tokens, rows = twin.generate(ids, body["n_predict"])
        probs = [{"id": t, "logprob": float(r[t]), "token": "", "bytes": [],
                  "top_logprobs": [{"id": i, "logprob": v, "token": "", "bytes": []} for i, v in row]}
                 for t, r, row in zip(tokens, rows, twin.top_rows(tokens, rows, k))]
        self._send(200, {"content": "", "tokens": tokens if body.get("return_tokens") else [], "stop": True,
                         "stop_type": "limit", "tokens_cached": 0, "tokens_evaluated": len(ids),
                         "completion_probabilities": probs})


class ManagedTwin(ManagedServer):
    """A managed server (engines/server.py: ManagedServer) whose command starts a correct twin: the managed path end to
    end (free port, readiness, log, stop) without a real server."""

    api = "openai"

    def launch(self, spec, port):
        return Launch([sys.executable, "-m", "kv_test_servers", "--checkpoint", str(spec.path), "--api", self.api,
                       "--port", str(port)], self.api, ready_timeout=120,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                          filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})


class ManagedTwinFailsToStart(ManagedTwin):
    """Its command exits at once, after printing why."""

    def launch(self, spec, port):
        return Launch([sys.executable, "-c", "import sys; print('twin: cannot load the model: no such file'); "
                       "sys.exit(3)"], "openai", env={}, ready_timeout=30)



def main() -> None:
    parser = argparse.ArgumentParser(description="a twin server (tests only), on 127.0.0.1")
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--api", default="openai")
    parser.add_argument("--bug", default=None)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    TwinServer(args.checkpoint, args.api, args.bug, args.port).serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
