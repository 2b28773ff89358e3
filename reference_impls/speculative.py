"""Reference engine: greedy speculative decoding over compiled_dynamic.py's growing KV cache, under torch.compile.

Each step, for every row of the batch: the drafter proposes up to k tokens from the row's context (its prompt and the
tokens generated so far); the target runs the row's last token and the proposals in ONE forward over its cache
(`verify`: logits at every position); the row keeps the longest prefix of proposals equal to its own greedy choices
and appends the bonus token, its choice right after them. Every token is the target's own greedy choice, so the
output is plain greedy decoding's. Near the end a row drafts at most max_new_tokens - generated - 1 (0: a plain
decode step), so no step overshoots.

Rollback of rejected K/V (dropping, not overwriting): a verify step appends 1 + D positions to every row (D: the most
proposals of any row; a row with fewer is padded, a finished row is all padding). A row keeps its first 1 + accepted
of them. `compact` gathers each row's kept positions to the right end of its row, in order (what is left over becomes
left padding, masked by `valid`: positions count real tokens only, model.Decoder.forward) and cuts the cache to the
longest row: on one row, a crop. After a call each row holds its prompt + max_new_tokens - 1 positions and the
longest no padding: KVLayout("dynamic"), as compiled_dynamic.py. Rows keeping different lengths in one step stay one
left-padded batch.

Rollback of a recurrent state (a hybrid model's Mamba2 or Gated DeltaNet layers): a state cannot be cropped, so the
verify step keeps the state after each of its new tokens (`model.StateSteps`) and each row goes on from the one after
its kept tokens (vLLM's speculative decoding over mamba states keeps the per-token states the same way); the rejected
drafts never reach it. A draft model on such a model keeps its states after each token it ran in the step (its
snapshots) and resumes from the one at the shared prefix, or runs the whole context again where it has none.

Drafters (`use_drafter`): a `Drafter` (contract/speculative.py) the caller gives, or a draft model (`DraftModel`: a
`ModelSpec` the caller gives, or by default the target with its weights perturbed, models/drafts.py: `perturb`).
``ref-speculative-lookup`` (`SpeculativePromptLookup`) drafts by prompt lookup instead (`PromptLookup`: the tokens
that followed the latest earlier occurrence of the context's last n-gram). A
draft model keeps its own growing cache per row between the steps of a call; before drafting it crops that cache to
what the new context shares with it (its rollback: the drafts the target rejected go) and runs the rest of the
context.

Compiles: prefill (last logits) and verify (logits of every new position over a cache), each compiled once per
engine (compile.compile_fresh) and run by the target and its draft models alike (the same architecture with other
weights is no recompile), with batch, prompt, cache and step lengths unbacked (compile.mark_dynamic, and the step
length): two compiles, then none, whatever k and the acceptance lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pytest_kvcompile.contract.engine import Declaration, KVLayout, ModelSpec
from pytest_kvcompile.contract.speculative import DRAFT_MODEL, DRAFTER, Drafter, Speculative
from pytest_kvcompile.models.drafts import perturb
from pytest_kvcompile.recompiles.hooks import mark_unbacked
from reference_impls.compile import compile_fresh, left_pad, mark_dynamic
from reference_impls.engine import Engine
from reference_impls.loader import load_model
from reference_impls.model import State, StateSteps

K = 4  # drafts per step
DRAFT_NOISE, DRAFT_SEED = 0.03, 42  # the default draft: the target perturbed (hf-assisted's noise: mixed acceptance)
PAD_ID = 0
KEPT_ROWS = 8  # draft caches a DraftModel keeps (one per row of the last calls)
NGRAM = 3  # the longest n-gram a PromptLookup matches


def prefill(model, tokens, valid):
    return model(tokens, valid)


def verify(model, tokens, valid, cache):
    return model(tokens, valid, cache, every=True)


class Compiled:
    """The engine's two compiled forwards, for the target and its draft models alike (a module of the same
    architecture with other weights is no recompile): every size unbacked."""

    def __init__(self, compile_backend: str):
        self.prefill, self.verify = compile_fresh(prefill, compile_backend), compile_fresh(verify, compile_backend)

    def __call__(self, model, tokens, valid, cache):
        """Prefill (cache empty): last logits [b, vocab]; over a cache: logits [b, t, vocab] of every new position.
        And the grown cache."""
        mark_dynamic(tokens, valid, cache or None)
        if not cache:
            return self.prefill(model, tokens, valid)
        mark_unbacked(tokens, 1)  # any number of new tokens over a cache: 1 + drafts, or a draft's context to catch up
        return self.verify(model, tokens, valid, cache)


class DraftModel:
    """A draft model as a `Drafter`: greedy drafts over its own growing cache, one per row, kept between steps."""

    def __init__(self, model: torch.nn.Module, compiled: Compiled):
        self.model, self.compiled = model, compiled
        # per row: (tokens the cache holds, per-layer (k, v) [1, n, h, d] or State, the states after each length run
        # in its last propose: length -> per recurrent layer)
        self.rows: list[tuple[list[int], list, dict[int, list[State]]]] = []
        self.snapshots: dict[int, list[State]] = {}

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k == 0:
            return []
        held, cache, snapshots = self._closest(context)
        start = min(common(held, context), len(context) - 1)  # run the last token at least: its logits draft
        kept = self._rollback(start, held)
        if any(isinstance(entry, State) for entry in cache) and kept not in snapshots:
            kept = start = 0  # no state after those positions: run the whole context
        states = iter(snapshots.get(kept, ()))
        cache = [next(states) if isinstance(entry, State) else (crop(entry[0], kept), crop(entry[1], kept))
                 for entry in cache] if kept else []
        self.snapshots = {}
        token, cache = self._next(list(context[start:]), kept, cache)
        drafts, past = [token], kept + len(context) - start
        while len(drafts) < k:
            token, cache = self._next(drafts[-1:], past, cache)
            drafts.append(token)
            past += 1
        # the last draft is not run
        self.rows = [*self.rows[-(KEPT_ROWS - 1):], ([*context, *drafts[:-1]], cache, self.snapshots)]
        return drafts

    def _closest(self, context: Sequence[int]) -> tuple[list[int], list, dict[int, list[State]]]:
        """The kept cache sharing the longest prefix with `context` (taken out: it is replaced), or an empty one."""
        best = max(self.rows, key=lambda row: common(row[0], context), default=None)
        if best is None or common(best[0], context) == 0:
            return [], [], {}
        self.rows.remove(best)
        return best

    def _rollback(self, start: int, held: list[int]) -> int:
        """Positions of the cache (holding `held`) to keep before running the context from `start` on: exactly those
        before it. The drafts the target rejected, and anything else past the shared prefix, are cut."""
        return start

    def _next(self, tokens: list[int], past: int, cache: list) -> tuple[int, list]:
        """Run `tokens` over the cache of `past` positions: the greedy next token, and the grown cache."""
        tokens = torch.tensor([tokens], device=self.model.lm_head.weight.device)
        valid = torch.ones(1, past + tokens.size(1), dtype=torch.bool, device=tokens.device)
        logits, cache = self.compiled(self.model, tokens, valid, cache)
        return int(logits.reshape(-1, logits.size(-1))[-1].argmax()), self._settle(cache, past, tokens.size(1))

    def _settle(self, cache: list, past: int, t: int) -> list:
        """Keep the recurrent states after each of the t tokens just run (`snapshots`, by length); the cache goes on
        from the last."""
        steps = [entry for entry in cache if isinstance(entry, StateSteps)]
        for j in range(t if steps else 0):
            self.snapshots[past + 1 + j] = [s.at(torch.tensor([j], device=s.conv.device)) for s in steps]
        if not steps and any(isinstance(entry, State) for entry in cache):
            self.snapshots[past + t] = [entry for entry in cache if isinstance(entry, State)]
        last = torch.tensor([t - 1], device=self.model.lm_head.weight.device)
        return [entry.at(last) if isinstance(entry, StateSteps) else entry for entry in cache]


class PromptLookup:
    """A `Drafter` by n-gram lookup in the context itself (prompt lookup): the up to k tokens that followed the latest
    earlier occurrence of the context's last n tokens, n from `ngram` down to 1; no occurrence: no draft."""

    def __init__(self, ngram: int = NGRAM):
        self.ngram = ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        context = [int(t) for t in context]
        for n in range(min(self.ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == tail:
                    return context[start + n:start + n + k]
        return []


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def crop(x: torch.Tensor, positions: int) -> torch.Tensor:
    """The first `positions` of a cache tensor [b, n, h, d], freshly allocated with contiguous strides (a view's
    would differ from the next step's and fail a stride guard: a recompile)."""
    return x[:, :positions].clone(memory_format=torch.contiguous_format)


def compact(valid: torch.Tensor, cache: list, state_at: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Drop the positions `valid` marks False: each row's others gathered to its right end, in order, the cache cut to
    the longest row (shorter rows left-padded, masked); a recurrent layer goes on from each row's state after its
    step's token `state_at` [b]."""
    length = int(valid.sum(1).max())
    order = torch.sort(valid.int(), dim=1, stable=True).indices[:, valid.size(1) - length:]

    def take(x):
        return x.gather(1, order[:, :, None, None].expand(-1, -1, *x.shape[2:]))

    return valid.gather(1, order), [entry.at(state_at) if isinstance(entry, StateSteps) else
                                    (take(entry[0]), take(entry[1])) for entry in cache]


class SpeculativeDecoding(Engine):
    """Greedy speculative decoding: k drafts per step verified in one compiled forward, rejected K/V dropped."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("dynamic", windowed=False, conv_window_offset=-1),  # the target's, as compiled_dynamic's
        compiled=True,
        speculative=Speculative(k=K, drafters=(DRAFTER, DRAFT_MODEL), acceptance=True),
        description=f"reference: speculative decoding, {K} drafts per step (default draft: the target perturbed), "
                    "verify in one forward, rejected K/V dropped per row (a recurrent state: the one after the kept "
                    "tokens), dynamic cache, torch.compile",
    )
    draft_model = DraftModel  # how a draft checkpoint runs

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", k: int = K,
                 draft: Drafter | ModelSpec | None = None):
        self.spec, self.k = spec, k
        self.model = load_model(spec, states=True)
        self.compiled = Compiled(compile_backend)
        self.own = self._drafter(draft) if draft is not None else self.draft_model(
            perturb(load_model(spec, states=True), DRAFT_NOISE, DRAFT_SEED), self.compiled)
        self.drafter = self.own
        self.cache: list = []  # the target's, after the last generate
        self.steps: list[list[tuple[int, int]]] = []  # per row of the last generate: (drafted, accepted) per step

    def _drafter(self, draft: Drafter | ModelSpec) -> Drafter:
        return self.draft_model(load_model(draft, states=True), self.compiled) if isinstance(draft, ModelSpec) \
            else draft

    def use_drafter(self, drafter: Drafter | ModelSpec | None) -> None:
        """Draft with `drafter` (a Drafter, or a draft checkpoint run as a DraftModel) from now on; None: the own."""
        self.drafter = self.own if drafter is None else self._drafter(drafter)

    def acceptance(self) -> list[list[tuple[int, int]]]:
        return self.steps

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        self.steps = [[] for _ in prompts]
        if max_new_tokens <= 0 or not prompts:
            self.cache = []
            return [[] for _ in prompts]
        tokens, valid = left_pad(prompts, self.spec.device)
        logits, cache = self.compiled(self.model, tokens, valid, None)
        out = [[t] for t in logits.argmax(-1).tolist()]
        while any(len(o) < max_new_tokens for o in out):
            drafts = [self.drafter.propose([*p, *o], min(self.k, max_new_tokens - len(o) - 1))
                      if len(o) < max_new_tokens else None for p, o in zip(prompts, out)]
            valid, cache = self._step(drafts, out, valid, cache)
        self.cache = cache
        if isinstance(self.drafter, DraftModel):
            self.drafter.rows = []  # a draft model's caches live as long as the call
        return out

    def _step(self, drafts: list[list[int] | None], out: list[list[int]], valid, cache):
        """Verify every row's drafts (None: the row is done) in one forward; extend `out` by what each row keeps and
        its bonus token; drop the rejected K/V. The new valid mask and cache."""
        width = 1 + max(len(d) for d in drafts if d is not None)
        fed = [[o[-1], *d] if d is not None else [] for o, d in zip(out, drafts)]
        tokens = torch.tensor([f + [PAD_ID] * (width - len(f)) for f in fed], device=self.spec.device)
        new = torch.tensor([[i < len(f) for i in range(width)] for f in fed], device=self.spec.device)
        logits, cache = self.compiled(self.model, tokens, torch.cat((valid, new), 1), cache)
        accepted: list[int | None] = []
        for row, (draft, choices) in enumerate(zip(drafts, logits.argmax(-1).tolist())):
            if draft is None:
                accepted.append(None)
                continue
            kept, bonus = self._accept(draft, choices)
            out[row] += [*draft[:kept], bonus]
            self.steps[row].append((len(draft), kept))
            accepted.append(kept)
        keep = torch.tensor(self._kept(drafts, accepted), device=new.device)
        return compact(torch.cat((valid, new & (torch.arange(width, device=new.device) < keep[:, None])), 1), cache,
                       self._state_at(keep, fed))

    def _state_at(self, keep: torch.Tensor, fed: list[list[int]]) -> torch.Tensor:
        """The token of this step after which each row's recurrent state goes on: its last kept one (a finished row:
        any, its state is never read again)."""
        return (keep - 1).clamp(min=0)

    def _accept(self, draft: list[int], choices: list[int]) -> tuple[int, int]:
        """Drafts kept (the longest prefix equal to the target's choice before each: choices[i] follows the row's
        last token and draft[:i]) and the bonus token: the target's choice after them."""
        accepted = next((i for i, t in enumerate(draft) if t != choices[i]), len(draft))
        return accepted, choices[accepted]

    def _kept(self, drafts: list[list[int] | None], accepted: list[int | None]) -> list[int]:
        """Positions of this step each row keeps: its last token and the drafts it accepted (a finished row: none).
        The rest, the rejected drafts and padding, is dropped by `compact`."""
        return [0 if a is None else 1 + a for a in accepted]

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(continuation), vocab]: prefill, then one verify step fed the continuation."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size, dtype=self.spec.dtype, device=self.spec.device)
        tokens, valid = left_pad([prompt], self.spec.device)
        logits, cache = self.compiled(self.model, tokens, valid, None)
        if len(continuation) == 1:
            return logits
        fed = torch.tensor([continuation[:-1]], device=self.spec.device)
        rest, _ = self.compiled(self.model, fed, torch.cat((valid, torch.ones_like(fed, dtype=torch.bool)), 1), cache)
        return torch.cat((logits, rest[0]))


class SpeculativePromptLookup(SpeculativeDecoding):
    """`SpeculativeDecoding` drafting by prompt lookup (`PromptLookup`), k drafts per step at most: the same verify
    step and rollback, drafts from the sequence instead of a model."""

    kv_declaration = dataclasses.replace(
        SpeculativeDecoding.kv_declaration,
        speculative=Speculative(k=K, drafters=(), acceptance=True, lookup=True),
        description=f"reference: speculative decoding by prompt lookup ({NGRAM}- to 1-gram, latest occurrence), up to "
                    f"{K} drafts per step, verify in one forward, rejected K/V dropped per row, dynamic cache, "
                    "torch.compile",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", k: int = K):
        super().__init__(spec, compile_backend=compile_backend, k=k, draft=PromptLookup())
