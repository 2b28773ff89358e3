"""The token oracle: what an engine's greedy output must equal.

For the ``exact`` strategy the reference is transformers eager greedy decoding with a
full ``DynamicCache`` on the same checkpoint, device and dtype: one forward over the
prompt, then one forward per new token (before transformers 4.56, which has no per-layer cache, one forward over the
whole sequence per token, no cache: ``models.checkpoints.per_layer_cache``), each token the argmax of the raw logits (no
logits processors: a checkpoint's ``generation_config``, e.g. a repetition penalty,
does not apply; no stop tokens). The per-step logits are kept so a divergence can be
classified as a near tie or a mismatch (see ``token_match``). ``teacher_forced`` gives the oracle's logits along the
engine's own tokens in one forward (a prefill of prompt + tokens): what a verdict reads (oracles/store.py), so the
greedy loop runs only where its tokens are read.

Every oracle has ``reference(prompt, max_new_tokens) -> Reference`` (oracles/reference.py) and
``teacher_forced(prompt, tokens, tie_tolerance) -> Tensor [len(tokens), vocab]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from pytest_kvcompile.contract.engine import ModelSpec, Strategy
from pytest_kvcompile.models.checkpoints import keep_last, positions, with_cache
from pytest_kvcompile.oracles.eviction import POLICIES, EvictionOracle, policy_for
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.truth import Widened, load_lm


class HFEagerOracle:
    """transformers eager greedy generation with a full DynamicCache (strategy ``exact``)."""

    source = "transformers eager greedy, full DynamicCache"

    def __init__(self, spec: ModelSpec, strategy: Strategy = Strategy()):
        from pytest_kvcompile.models.checkpoints import per_layer_cache

        self.spec = spec
        if not per_layer_cache():
            self.source = "transformers eager greedy, no cache (the whole sequence each step: transformers < 4.56)"

    def __repr__(self) -> str:
        return f"<oracle: {self.source}, model '{self.spec.name}'>"

    @functools.cached_property
    def model(self) -> Any:
        """The checkpoint, loaded on first use: a run whose references and logits all come from the disk store
        (oracles/store.py) loads no oracle model."""
        return load_lm(self.spec, widened=True)

    def reference(self, prompt: list[int] | tuple[int, ...], max_new_tokens: int) -> Reference:
        """The greedy reference, computed anew each call (oracles/store.py memoizes: one copy of its [steps, vocab]
        rows, 300 MB for 500 steps of a 152k vocabulary)."""
        prompt = tuple(prompt)
        greedy = self._verified if isinstance(self.model, Widened) else self._run
        tokens, rows = greedy(prompt, max_new_tokens)
        return Reference(prompt, tokens, rows, self.source, lambda got, tol: self.teacher_forced(prompt, got, tol))

    #: teacher_forced is one forward (oracles/store.py judges an engine's tokens with it and decodes the greedy
    #: reference only where something reads it)
    one_forward = True

    @torch.inference_mode()
    def teacher_forced(self, prompt: Sequence[int], tokens: Sequence[int], tie_tolerance: float = 0.0) -> torch.Tensor:
        """The logits [len(tokens), vocab] at each step of prompt + `tokens` (row i predicts tokens[i]): one forward
        over prompt + tokens[:-1] through a fresh cache (a prefill, as every engine's; KV-sharing layers need one in
        some transformers versions), without a cache before 4.56 (`per_layer_cache`). The same function as the greedy
        loop's steps, computed at once: rows differ from the loop's by rounding alone (~1e-6 in float32)."""

        return self._forced(prompt, [int(t) for t in tokens], self.model).float().cpu()

    def _forced(self, prompt: Sequence[int], tokens: list[int], model: Any) -> torch.Tensor:
        """`teacher_forced`'s logits in the model's own dtype, on its device."""
        from pytest_kvcompile.models.checkpoints import dynamic_cache, per_layer_cache

        if not tokens:
            return torch.empty(0, self.spec.vocab_size)
        ids = torch.tensor([list(prompt) + tokens[:-1]], device=self.spec.device)
        cache = dynamic_cache(model.config) if per_layer_cache() else None
        return model(input_ids=ids, **with_cache(cache), use_cache=cache is not None,
                     **keep_last(model, len(tokens))).logits[0, -len(tokens):]

    @torch.inference_mode()
    def _run(self, prompt: tuple[int, ...], steps: int, model: Any = None):
        """Greedy decoding, one forward per token through a cache (`model`: another one, e.g. the stored weights)."""
        from pytest_kvcompile.models.checkpoints import dynamic_cache, per_layer_cache

        model = model or self.model
        cache = dynamic_cache(model.config) if per_layer_cache() else None
        sequence, tokens, rows = list(prompt), [], []
        for step in range(steps):
            fed = sequence if cache is None or step == 0 else sequence[-1:]  # no cache: the whole sequence again
            ids = torch.tensor([fed], device=self.spec.device)
            logits = model(input_ids=ids, **with_cache(cache), use_cache=cache is not None,
                           **positions(len(sequence) - len(fed), len(fed), self.spec.device)).logits[0, -1]
            rows.append(logits.float().cpu())
            tokens.append(int(logits.argmax()))
            sequence.append(tokens[-1])
        return tuple(tokens), torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)

    @torch.inference_mode()
    def _verified(self, prompt: tuple[int, ...], steps: int):
        """The widened truth's greedy decoding without widening its weights once per token (the cost of a step of a
        large model: reading them all): the stored weights draft the rest greedily in their own dtype, one widened
        forward over the draft (through the truth's float64 cache of what it verified) gives the truth's logits at
        every drafted step, and the draft is kept up to its first token that is not the truth's argmax, which the
        truth's own replaces (the cache cropped back to it); then the next draft. Each token is the truth's argmax
        after the truth's own tokens, through its own cache: the greedy loop's tokens and logits (rounding apart), in
        1 + (the 16-bit flip count) widened forwards, each position computed about once."""
        from pytest_kvcompile.models.checkpoints import dynamic_cache, per_layer_cache

        sequence, tokens, rows = list(prompt), [], []
        cache, cached = (dynamic_cache(self.model.config), 0) if per_layer_cache() else (None, 0)
        while len(tokens) < steps:
            draft = list(self._run(tuple(sequence), steps - len(tokens), self.model.model)[0])
            if cache is None:  # before 4.56: the whole sequence again
                truth = self._forced(sequence, draft, self.model)
            else:
                ids = torch.tensor([sequence[cached:] + draft[:-1]], device=self.spec.device)
                truth = self.model(input_ids=ids, **with_cache(cache), use_cache=True,
                                   **positions(cached, ids.shape[1], self.spec.device),
                                   **keep_last(self.model, len(draft))).logits[0, -len(draft):]
                held = cached + ids.shape[1]  # what the cache holds now (transformers' get_seq_length() raises on
                # a cache of recurrent layers alone)
            for row, drafted in zip(truth, draft):
                best = int(row.argmax())
                rows.append(row.float().cpu())
                tokens.append(best)
                sequence.append(best)
                if best != drafted:
                    break
            cached = len(sequence) - 1  # fed: all but the last token; the cache holds the rest of the draft too
            if cache is not None and held > cached:
                try:
                    cache.crop(cached)
                except (AttributeError, NotImplementedError, ValueError, RuntimeError):  # a layer that cannot crop
                    cache, cached = dynamic_cache(self.model.config), 0
        return tuple(tokens), torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)


class NoOracle(LookupError):
    """No oracle exists for the strategy an engine declares."""


#: Strategy kind -> oracle class, called as ``cls(spec, strategy)``; the result has
#: ``reference(prompt, max_new_tokens) -> Reference`` and ``source``.
ORACLES: dict[str, type] = {
    "exact": HFEagerOracle,
    **dict.fromkeys(POLICIES, EvictionOracle),
}


#: Strategy kinds that declare no oracle: engines get every oracle-free check, token checks are skipped.
WITHOUT_ORACLE = "without_oracle"


def known_kinds() -> list[str]:
    return sorted([*ORACLES, WITHOUT_ORACLE])


def check_strategy(strategy: Strategy) -> str | None:
    """Why `strategy` cannot be used (unknown kind, bad parameters), or None. Checked at start-up."""
    if strategy.kind == WITHOUT_ORACLE:
        return None
    if strategy.kind not in ORACLES:
        return (f"strategy kind '{strategy.kind}' is unknown; known: {', '.join(known_kinds())}. An engine whose "
                f"cache semantics no oracle covers declares Strategy.of('{WITHOUT_ORACLE}', name='...'): it then "
                "gets every oracle-free check (determinism, stale state, batch consistency, recompiles, memory)")
    if strategy.kind != "exact":
        try:
            policy_for(strategy)
        except ValueError as exc:
            return str(exc)
    return None


def budget_of(strategy: Strategy) -> int | None:
    """The cache budget of a budgeted eviction strategy, else None (exact, prefill-only, no oracle)."""
    if strategy.kind in ("exact", WITHOUT_ORACLE) or strategy.kind not in ORACLES:
        return None
    budget = getattr(policy_for(strategy), "budget", None)
    return budget if isinstance(budget, int) else None


def exercising_lengths(strategy: Strategy) -> dict[str, int]:
    """Prompt lengths that make `strategy` act (name -> length): budget+1 and 2*budget+3 for a budgeted
    eviction policy (prefill-only policies compress any prompt)."""
    budget = budget_of(strategy)
    if budget is None:
        return {}
    return {f"budget+1={budget + 1}": budget + 1, f"2*budget+3={2 * budget + 3}": 2 * budget + 3}


def oracle_for(strategy: Strategy, spec: ModelSpec):
    """The oracle that decides whether an engine with `strategy` is right on `spec`."""
    if strategy.kind not in ORACLES:
        raise NoOracle(f"strategy '{strategy}' declares no oracle (oracles exist for: {', '.join(sorted(ORACLES))})")
    return ORACLES[strategy.kind](spec, strategy)
