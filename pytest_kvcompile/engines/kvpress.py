"""NVIDIA kvpress (0.5.5) presses as engines: the transformers model with a press compressing
the KV cache ONCE, during prefill, then greedy decoding over a growing DynamicCache.

- ``kvpress-streaming``: ``StreamingLLMPress(compression_ratio=0.5, n_sink=2)``
- ``kvpress-snapkv``: ``SnapKVPress(compression_ratio=0.5, window_size=2, kernel_size=3)``
- ``kvpress-tova``: ``TOVAPress(compression_ratio=0.5)``
- ``kvpress-knorm``: ``KnormPress(compression_ratio=0.5)``
- ``kvpress-decoding-knorm``: ``DecodingPress(KnormPress(), compression_interval=4, target_size=8)``, which
  compresses DURING decoding (every 4 steps each layer's cache is cut to 8 entries by key norm). No oracle
  covers decode-time compression: the oracle-free checks judge it (determinism, stale state, batch and
  prefix consistency). kvpress 0.4.0-0.5.1 kept its step counters across calls, so a second identical call
  compressed at other steps (fixed in 0.5.2; docs/released-bugs.md).
- ``kvpress-streaming-rerotated``: ``KeyRerotationPress(StreamingLLMPress(compression_ratio=0.5, n_sink=2))``:
  the kept keys are re-rotated to positions 0..n_kept-1 and decoding goes on at n_kept (as kvpress's pipeline
  does for a KeyRerotationPress), held to ``streaming_llm_prefill(..., positions="shifted")``. Runs on kvpress
  0.2.x (transformers 4.53: the eviction oracle needs its masking_utils) as on 0.5.5. kvpress <= 0.2.6
  un-rotated with the model's (cos, -sin), which under YaRN carry the attention factor: keys off by its square
  (PR #85, fixed in 0.2.7); zoo model ``llama-yarn`` (named only) shows it.

Each is held to the eviction oracle of its ``*_prefill`` strategy (pytest_kvcompile/oracles/eviction.py),
whose parameters are the press's keyword arguments, so ``kv_declaration.strategy`` is the one
place they are written. The defaults make every suite prompt of 7 tokens or more evict (an
n-token prompt keeps int(n / 2)) and keep the protected entries within that count (2 sinks,
a 2-token observation window). Other parameters: ``StreamingLLM.configure(compression_ratio=0.3)``
returns an engine class with that strategy (pass it as ``--kv-engine=module:attr``).

Per prompt, as kvpress's own pipeline does it (``KVPressTextGenerationPipeline``; it needs a
tokenizer, the zoo has none): a fresh DynamicCache, the prompt in one forward of the eager
model inside ``with press(model)`` (the press's hook compresses each layer's cache after that
layer's attention, so the prefill's own logits are exact), then one forward per new token with
``position_ids`` continuing at the prompt length (keys are not re-rotated). One prompt at a time:
kvpress has no left-padding support (its scores ignore the attention mask).
"""

from __future__ import annotations

import contextlib

import torch

from pytest_kvcompile.contract.engine import (
    Declaration,
    ModelNotSupported,
    ModelSpec,
    Strategy,
    declaration_of,
)
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.verdicts.failures import Kind

RECIPE = Recipe(packages=("kvpress==0.5.5",),
                 note="kvpress 0.5.5 pins transformers<5.3 (resolves to 5.2.0; on 5.23 its presses fail with "
                 "KeyError: 'cache_position'); its presses run on CPU. docs/engines/kvpress.md")
REQUIRES = RECIPE.requirement("kvpress")


class KVPress:
    """Greedy generation with `press` (a kvpress class name) applied during prefill; the press's
    keyword arguments are the declared strategy's parameters."""

    press: str
    kv_declaration: Declaration
    press_in_decode = False  # the press acts during prefill only; a decoding press stays on while decoding

    def __init__(self, spec: ModelSpec):
        import kvpress

        from pytest_kvcompile.models.checkpoints import pretrained

        _check_supported(spec)
        self.spec = spec
        self.press_object = self._make_press(kvpress)
        self.model = pretrained(spec.path, spec.dtype, attn_implementation="eager").to(spec.device).eval()
        if not isinstance(self.model, _supported_classes()):
            version = getattr(kvpress, "__version__", "")
            raise ModelNotSupported(f"kvpress {version} does not support {type(self.model).__name__} "
                                    f"(its SUPPORTED_MODELS: {', '.join(c.__name__ for c in _supported_classes())})")
        self.cache = None  # the last prompt's cache, for kept_lengths()

    def _make_press(self, kvpress):
        """The press from the strategy's parameters; ``positions="shifted"`` wraps it in ``KeyRerotationPress``."""
        params = dict(declaration_of(type(self)).strategy.params)
        press = getattr(kvpress, self.press)(**{k: v for k, v in params.items() if k != "positions"})
        return kvpress.KeyRerotationPress(press=press) if params.get("positions") == "shifted" else press

    @classmethod
    def configure(cls, **params) -> type[KVPress]:
        """An engine class whose press (and strategy) takes `params` instead of the defaults. Known findings
        cover the suite's 1-token prompt only: a press fails on any prompt of n <= n_sink or n <= window_size tokens."""
        strategy = cls.kv_declaration.strategy
        merged = Strategy.of(strategy.kind, **{**dict(strategy.params), **params})
        return type(cls.__name__, (cls,), {"kv_declaration": _declaration(merged, cls.press)})

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [self._run(p, max_new_tokens) for p in prompts]

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab] through the same compressed prefill and decode, fed `continuation`."""
        rows: list[torch.Tensor] = []
        self._run(prompt, len(continuation), forced=list(continuation), rows=rows)
        return torch.stack(rows) if rows else torch.empty(0, self.spec.vocab_size)

    def kept_lengths(self) -> list[int]:
        """Per layer: the entries the last prompt's cache holds (n_kept + new tokens - 1)."""
        if not hasattr(self.cache, "layers"):  # transformers < 4.56 (kvpress 0.2.x): one list of keys
            return [keys.shape[2] for keys in self.cache.key_cache]
        return [layer.keys.shape[2] for layer in self.cache.layers]

    @torch.inference_mode()
    def _run(self, prompt, steps: int, forced=None, rows=None) -> list[int]:
        from pytest_kvcompile.models.checkpoints import dynamic_cache

        if steps <= 0:
            return []
        device = self.spec.device
        self.cache = dynamic_cache(self.model.config)
        tokens = []
        with contextlib.ExitStack() as pressed:
            pressed.enter_context(self.press_object(self.model))
            logits = self.model(input_ids=torch.tensor([list(prompt)], device=device), **with_cache(self.cache),
                                logits_to_keep=1).logits[0, -1]
            if not self.press_in_decode:
                pressed.close()  # the press's hooks come off: decoding runs over the compressed cache as it is
            # KeyRerotationPress re-rotated the kept keys to 0..n_kept-1: kvpress's pipeline then decodes from the
            # cache length (`context_length = cache.get_seq_length()`), other presses from the prompt length.
            start = self.cache.get_seq_length() if self._rerotated() else len(prompt)
            for step in range(steps):
                if rows is not None:
                    rows.append(logits.float().cpu())
                tokens.append(forced[step] if forced else int(logits.argmax()))
                if step + 1 < steps:
                    logits = self.model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                                        **with_cache(self.cache),
                                        position_ids=torch.tensor([[start + step]], device=device)).logits[0, -1]
        return tokens

    def _rerotated(self) -> bool:
        return type(self.press_object).__name__ == "KeyRerotationPress"


def _supported_classes() -> tuple[type, ...]:
    from kvpress.presses.base_press import SUPPORTED_MODELS

    return SUPPORTED_MODELS


def _check_supported(spec: ModelSpec) -> None:
    """kvpress 0.5.5 compresses a sliding-window layer's cache (transformers keeps its last W-1 keys)
    against the full prompt's attention: every press then fails on transformers 5.2 (mask or index
    shape errors, docs/engines/kvpress.md)."""
    config = spec.config.get_text_config() if hasattr(spec.config, "get_text_config") else spec.config
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) or "sliding_attention" in layer_types:
        raise ModelNotSupported(
            f"kvpress 0.5.5 does not handle sliding-window layers ('{spec.name}' has sliding_window="
            f"{getattr(config, 'sliding_window', None)}): its presses compress the W-1 keys transformers keeps "
            "against the whole prompt's attention and fail (shape errors); see docs/engines/kvpress.md")


def _declaration(strategy: Strategy, press: str) -> Declaration:
    params = dict(strategy.params)
    args = ", ".join(f"{k}={v}" for k, v in params.items() if k != "positions")
    pressed = f"KeyRerotationPress({press}({args}))" if params.get("positions") == "shifted" else f"{press}({args})"
    return Declaration(
        strategy=strategy, scoring=True, requires=REQUIRES,
        description=f"kvpress {pressed} at prefill, transformers eager, DynamicCache",
        known_findings=_findings(strategy))


def _findings(strategy: Strategy) -> tuple[KnownFinding, ...]:
    """What the suites find on kvpress 0.5.5 with these parameters (docs/engines/kvpress.md): the presses
    that fail on the suite's 1-token prompt (test_stale_state's shortest prompt is that one, the recompile
    check's warmup serves one, and so does the prefix-cache suite's full-hit check: ``hit1``)."""
    params = dict(strategy.params)
    reason = {
        "streaming_llm_prefill": params.get("n_sink", 0) >= 1
        and "StreamingLLMPress asserts a prompt longer than n_sink: a 1-token prompt raises AssertionError",
        "snapkv_prefill":
        "SnapKVPress asserts a prompt longer than window_size: a 1-token prompt raises AssertionError",
        "tova_prefill": "TOVAPress takes max() of the empty score tensor of a 1-token prompt: RuntimeError",
    }.get(strategy.kind)
    raised = "AssertionError" if strategy.kind != "tova_prefill" else "RuntimeError"
    if not reason:
        return ()
    # the engine raises in a generate() call of one 1-token prompt (test_stale_state_batched needs batching: skipped)
    return (KnownFinding("test_token_identity", Kind.OTHER, reason, prompts=("len1",), raised=raised, prompt_length=1,
                         batched=False),
            *(KnownFinding(check, Kind.OTHER, reason, raised=raised, prompt_length=1, batched=False)
              for check in ("test_stale_state", "test_no_recompiles_after_warmup", "test_full_hit")))


def _engine(name: str, press: str, strategy: Strategy) -> type[KVPress]:
    return type(name, (KVPress,), {"press": press, "kv_declaration": _declaration(strategy, press),
                                   "__doc__": f"kvpress {press} at prefill ({strategy})."})


StreamingLLM = _engine("StreamingLLM", "StreamingLLMPress",
                       Strategy.of("streaming_llm_prefill", compression_ratio=0.5, n_sink=2))
SnapKV = _engine("SnapKV", "SnapKVPress",
                 Strategy.of("snapkv_prefill", compression_ratio=0.5, window_size=2, kernel_size=3))
TOVA = _engine("TOVA", "TOVAPress", Strategy.of("tova_prefill", compression_ratio=0.5))
KNorm = _engine("KNorm", "KnormPress", Strategy.of("knorm_prefill", compression_ratio=0.5))
StreamingLLMRerotated = _engine(
    "StreamingLLMRerotated", "StreamingLLMPress",
    Strategy.of("streaming_llm_prefill", compression_ratio=0.5, n_sink=2, positions="shifted"))

class DecodingKnorm(KVPress):
    """kvpress ``DecodingPress(KnormPress(), compression_interval=4, target_size=8)``: prefill and every decode
    step run inside ``with press(model)``, as kvpress's pipeline does for decoding presses; one press object
    serves every call, as a user's would."""

    press = "DecodingPress"
    kv_declaration = Declaration(
        strategy=Strategy.of("without_oracle", name="kvpress-decoding-knorm"), scoring=True, requires=REQUIRES,
        description="kvpress DecodingPress(KnormPress(), compression_interval=4, target_size=8), compresses "
                    "during decoding; oracle-free checks")
    params = {"compression_interval": 4, "target_size": 8, "hidden_states_buffer_size": 0}
    press_in_decode = True

    def _make_press(self, kvpress):
        return kvpress.DecodingPress(base_press=kvpress.KnormPress(), **self.params)


__all__ = ["REQUIRES", "TOVA", "DecodingKnorm", "KNorm", "KVPress", "SnapKV", "StreamingLLM", "StreamingLLMRerotated"]
