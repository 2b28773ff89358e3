"""Built-in engines wrapping transformers' own `generate()`.

- ``hf-eager``: eager greedy generation with a full DynamicCache (what the oracle does).
- ``hf-static-compile``: a StaticCache of fixed length, decode step compiled by `generate()`.
- ``hf-dynamic-compile``: a DynamicCache with the model's forward under `torch.compile`.
- ``hf-static-chunked-compile``: the user-facing static path, ``cache_implementation="static"`` +
  ``prefill_chunk_size`` + a compile config: generate() makes (and keeps) the cache and compiles the chunked
  prefill as well as the decode step. The path of transformers #46421 (docs/released-bugs.md).
- ``hf-assisted``: assisted (speculative) greedy decoding, ``generate(assistant_model=<draft>)``: the draft's and
  the target's caches are cropped after every rejected draft token. The path of transformers #48280.
- ``hf-prompt-lookup``: prompt-lookup decoding, ``generate(prompt_lookup_num_tokens=4)``: drafts looked up in the
  sequence itself, the target's cache cropped after a rejection.

They are measured, not tuned: whatever the suite finds is what transformers does.
Every call builds a fresh cache; greedy decoding runs with a clean GenerationConfig
(no stop token, no logits processor), so each prompt gets exactly `max_new_tokens` ids.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor

from pytest_kvcompile.contract.engine import Bounds, Declaration, KVLayout, ModelNotSupported, ModelSpec
from pytest_kvcompile.contract.findings import KnownFinding
from pytest_kvcompile.contract.speculative import DRAFT_MODEL, Speculative
from pytest_kvcompile.memory.measure import cache_tensors, held_bytes
from pytest_kvcompile.models.checkpoints import cache_keyword, pretrained, returned_cache, with_cache
from pytest_kvcompile.models.drafts import perturb
from pytest_kvcompile.models.layers import layer_caches
from pytest_kvcompile.recompiles.hooks import compile_on_every_device, forced_eager
from pytest_kvcompile.recompiles.recorder import CompileRecorder
from pytest_kvcompile.verdicts.failures import Kind

_PAD_ID = 0  # left padding value; padded positions are masked, so any id works
MAX_CACHE_LEN = 512  # hf-static-compile's fixed StaticCache length (the suites' prompts reach 266 positions)
#: what a call may hold: a trained checkpoint's longer position table takes the suites' long generations past it
CAPACITY = Bounds(max_positions=MAX_CACHE_LEN)
MAX_BATCH_SIZE = 4  # hf-static-compile's cache rows: batches are padded to it (dummy rows), larger ones chunked


class HFEager:
    """transformers eager greedy `generate()` with a full DynamicCache."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("dynamic"),
        kv_released=True,
        description="transformers generate(), eager, full DynamicCache",
    )

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.model = pretrained(spec.path, spec.dtype).to(spec.device).eval()
        # generate() fills every unset field from model.generation_config (e.g. a checkpoint's
        # eos_token_id or repetition_penalty): a clean one keeps those out.
        self.model.generation_config = GenerationConfig()
        self._kv_bytes = 0

    def _generation_config(self, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                return_dict_in_generate=True)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self._generate(prompts, max_new_tokens)

    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits [len(continuation), vocab] from generate()'s own prefill + decode path, fed `continuation`."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size)
        forced = _ForceTokens(continuation)
        if self._generate([prompt], len(continuation), forced)[0] != list(continuation):
            raise RuntimeError("generate() did not follow the forced continuation: a logits processor interfered")
        return torch.stack(forced.rows)

    def kv_cache_bytes(self) -> int:
        """Bytes of the storages behind the cache's key/value tensors at the end of the last generate()
        (a StaticCache: its whole preallocated buffers)."""
        return self._kv_bytes

    def _cache_kwargs(self) -> dict:
        """Extra generate() arguments choosing the cache (none: generate()'s default DynamicCache)."""
        return {}

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_new_tokens: int,
                  processor: LogitsProcessor | None = None) -> list[list[int]]:
        if not prompts or max_new_tokens == 0:
            self._kv_bytes = 0
            return [[] for _ in prompts]
        longest = max(len(p) for p in prompts)
        input_ids = torch.tensor([[_PAD_ID] * (longest - len(p)) + list(p) for p in prompts], device=self.spec.device)
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts],
                                      device=self.spec.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(max_new_tokens),
            logits_processor=[processor] if processor else None,
            **self._cache_kwargs(),
        )
        self._kv_bytes = held_bytes(cache_tensors(returned_cache(out)))
        return out.sequences[:, longest:].tolist()


class _CompiledMixin:
    """Raises unless dynamo compiled a frame during this engine's calls: a silent eager run is not 'compiled'.

    Checked on every call until a compile is seen, except under ``set_stance("force_eager")`` (the engine as its
    own eager oracle, oracles/engine.py). Compiles that hit dynamo's recompile limit
    do not count (dynamo runs that frame eagerly from then on).
    """

    _compiled_frames = 0

    def _generate(self, prompts, max_new_tokens, processor=None):
        with CompileRecorder() as recorder:
            tokens = super()._generate(prompts, max_new_tokens, processor)
        self._compiled_frames += sum(not event.limit_hit for event in recorder.events)
        if prompts and max_new_tokens > 1 and self._compiled_frames == 0 and not forced_eager():
            raise RuntimeError(
                f"{type(self).__name__}: generate() ran but dynamo compiled no frame, so nothing shows this "
                "engine ran compiled code. Either transformers skipped compilation (its warning 'unable to "
                "meet the criteria for compilation'), or dynamo reused code compiled earlier in this process "
                "for an identical model, or its recompile limit was already hit on transformers' shared "
                "forward wrapper; call pytest_kvcompile.recompiles.recorder.reset_dynamo() before the engine's "
                "first generate()"
            )
        return tokens


class HFStaticCompile(_CompiledMixin, HFEager):
    """`generate()` with one StaticCache of `max_cache_len` positions and `max_batch_size` rows, and its compiled
    decode step.

    transformers compiles only the decode step (prefill runs eagerly) and, off CUDA, only with
    the private `CompileConfig._compile_all_devices` flag. One cache serves every call, `reset()` first (the way a
    serving engine keeps its buffers): on CUDA transformers compiles with `mode="reduce-overhead"`, and cudagraph
    trees record a new graph whenever the cache's tensors are new ones (a fresh cache per call re-recorded a graph on
    every call: docs/gpu-results.md, finding 1). The batch is padded to `max_batch_size` rows with one-token dummy
    prompts, so one cache shape (and one graph) serves every batch; larger batches run in chunks. The cache length is
    fixed per engine (prompt + new tokens must fit, else ValueError): sizing it per call would recompile the decode
    step for every new length.
    """

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        compiled=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_CACHE_LEN, rows=MAX_BATCH_SIZE),
        bounds=CAPACITY,
        description="transformers generate(), one StaticCache (fixed max_cache_len, batch padded to 4 rows) reset per "
                    "call, compiled decode step",
        known_findings=(KnownFinding(
            "test_no_recompiles_after_warmup", Kind.RECOMPILE,
            "transformers 5.23: the sliding-window cache layer guards on its Python int cumulative_length_int "
            "(cache_utils.py:550/554), so a 1-token prompt recompiles the decode step (docs/findings.md)",
            models=("mistral-sw", "gemma3-hybrid", "gemma4-kvshared", "gpt-oss")),),
    )

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor", max_cache_len: int = MAX_CACHE_LEN,
                 max_batch_size: int | None = MAX_BATCH_SIZE):
        super().__init__(spec)
        self.max_cache_len, self.max_batch_size = max_cache_len, max_batch_size
        from transformers import CompileConfig  # 4.47 on: imported here so that hf-eager runs on older releases

        self.compile_config = compile_on_every_device(CompileConfig(backend=compile_backend))
        self.cache = None  # a StaticCache, made at the first call, then reset and reused

    def _generation_config(self, max_new_tokens: int) -> GenerationConfig:
        config = super()._generation_config(max_new_tokens)
        config.compile_config = self.compile_config
        return config

    def _cache_kwargs(self) -> dict:
        """The engine's one StaticCache, reset. Not `cache_implementation="static"`: transformers 5.2 ignores
        generation_config.max_cache_len there (sizes the cache prompt + new tokens)."""
        from transformers import StaticCache

        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        else:
            self.cache.reset()
        return with_cache(self.cache)

    def _generate(self, prompts, max_new_tokens, processor=None):
        needed = max((len(p) for p in prompts), default=0) + max_new_tokens
        if needed > self.max_cache_len:
            raise ValueError(
                f"{type(self).__name__}: prompt + max_new_tokens = {needed} exceeds max_cache_len="
                f"{self.max_cache_len}; build the engine with a larger max_cache_len"
            )
        if self.max_batch_size is None:  # generate() owns the cache (hf-static-chunked-compile)
            return super()._generate(prompts, max_new_tokens, processor)
        out = []
        for start in range(0, len(prompts), self.max_batch_size):
            out += self._padded(prompts[start:start + self.max_batch_size], max_new_tokens, processor)
        return out

    def _padded(self, prompts, max_new_tokens, processor):
        """generate() on `prompts` plus one-token dummy rows up to max_batch_size; the dummies' tokens dropped."""
        rows = list(prompts) + [[_PAD_ID]] * (self.max_batch_size - len(prompts))
        return super()._generate(rows, max_new_tokens, processor)[:len(prompts)]


PREFILL_CHUNK = 16  # hf-static-chunked-compile's prefill chunk: the suites' prompts (1..266 tokens) split unevenly


class HFStaticChunkedCompile(HFStaticCompile):
    """`generate()` as its documentation shows the static path: ``cache_implementation="static"``,
    ``max_cache_len``, ``prefill_chunk_size`` and a compile config, with generate() owning the cache (created,
    kept on the model and reused across calls by transformers itself). Chunked prefill compiles the prefill
    chunks too. Off CUDA transformers compiles only with the private ``CompileConfig._compile_all_devices``."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        compiled=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_CACHE_LEN),
        bounds=CAPACITY,
        kv_released=True,
        description="transformers generate(), cache_implementation='static', max_cache_len, prefill_chunk_size=16, "
                    "compiled",
        known_findings=(KnownFinding(
            "test_no_recompiles_after_warmup", Kind.RECOMPILE,
            "transformers 5.13-5.23: chunked prefill recompiles the compiled forward for new last-chunk lengths "
            "(prompt length mod 16: 1, then others) and new batch sizes; on sliding-window models also the "
            "cache layer's int guard of hf-static-compile (docs/released-bugs.md)",
        ), KnownFinding(
            "test_fuzz", Kind.RECOMPILE, "the same finding, met by the fuzzer (docs/released-bugs.md)",
        )),
    )

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor", max_cache_len: int = MAX_CACHE_LEN,
                 prefill_chunk_size: int = PREFILL_CHUNK):
        super().__init__(spec, compile_backend, max_cache_len, max_batch_size=None)
        self.prefill_chunk_size = prefill_chunk_size

    def _cache_kwargs(self) -> dict:
        """None: generate() makes (and, before transformers 5.15, keeps) the cache from the config below."""
        return {}

    def _generation_config(self, max_new_tokens: int) -> GenerationConfig:
        config = super()._generation_config(max_new_tokens)  # with the compile config
        config.cache_implementation = "static"
        config.max_cache_len = self.max_cache_len  # transformers >= 5.13
        config.cache_config = {"max_cache_len": self.max_cache_len}  # how < 5.13 documented it (ignored: #46424)
        config.prefill_chunk_size = self.prefill_chunk_size
        return config


class HFDynamicCompile(_CompiledMixin, HFEager):
    """`generate()` with a DynamicCache and the model's forward under `torch.compile` (prefill and decode)."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        compiled=True,
        kv_layout=KVLayout("dynamic"),
        kv_released=True,
        description="transformers generate(), DynamicCache, torch.compile'd forward",
        known_findings=(KnownFinding(
            "test_no_recompiles_after_warmup", Kind.RECOMPILE,
            "transformers 5.23: the compiled forward guards on cache state (is_initialized, keys None vs tensor, "
            "len(kwargs), sizes 0/1), recompiles on new lengths and batch sizes and hits dynamo's recompile "
            "limit (8), falling back to eager (docs/findings.md)",
        ), KnownFinding(
            "test_fuzz", Kind.RECOMPILE,
            "the same finding, met by the fuzzer: a 1-token prompt after the warmup recompiles the forward, which "
            "has hit dynamo's recompile limit (docs/findings.md)",
        )),
    )

    def __init__(self, spec: ModelSpec, compile_backend: str = "inductor"):
        super().__init__(spec)
        self.model.forward = torch.compile(self.model.forward, backend=compile_backend, dynamic=None)


NUM_ASSISTANT_TOKENS = 4  # hf-assisted's draft burst: 4 tokens per round, so a rejection crops up to 4 positions
DRAFT_NOISE = 0.03  # relative std of the noise added to the draft's weights (acceptance measured: HFAssisted)
DRAFT_SEED = 48280


class HFAssisted(HFEager):
    """Assisted greedy `generate()`: ``assistant_model=`` a draft proposes `num_assistant_tokens` tokens per round,
    the target checks them in one forward, and both caches are cropped back past the first rejected token.

    Greedy assisted decoding keeps only tokens the target itself would pick, so it must equal plain greedy (the exact
    oracle). The draft is the same checkpoint with every weight outside the norms perturbed by
    ``DRAFT_NOISE * std(weight) * N(0, 1)`` (``torch.Generator().manual_seed(DRAFT_SEED)``, sorted-name order): same
    architecture and sliding layers, so its own cache takes the same path (transformers #48280 was in the draft's
    cache), but it disagrees often: on transformers 5.23, 32 new tokens, 45 % of drafted tokens are accepted on the
    zoo's llama, 49 % on mistral-sw, 72 % on gemma3-hybrid, and 69 %, 67 %, 42 % of rounds reject one (a 0.5 noise
    accepted under 2 %, so nothing but the first token would ever be tested). The draft proposes a constant 4 tokens
    (``num_assistant_tokens_schedule="constant"``, no confidence cut-off). transformers runs assisted generation at
    batch size 1 only, so no batching; no scoring.

    Speculative (contract/speculative.py): ``use_drafter()`` takes a draft checkpoint (the suite's, with the same
    burst), ``acceptance()`` reads each round from the target's forwards (a forward pre-hook: where each starts in the
    cache and how many tokens it runs): a round runs the last token and its drafts (the first one: the prompt and its
    drafts), and the next starts after what it kept.
    """

    kv_declaration = Declaration(
        kv_released=True,
        speculative=Speculative(k=NUM_ASSISTANT_TOKENS, drafters=(DRAFT_MODEL,), acceptance=True),
        description=f"transformers generate(assistant_model=<draft: same checkpoint, weights perturbed>), greedy, "
                    f"{NUM_ASSISTANT_TOKENS} draft tokens per round, DynamicCache",
    )

    def __init__(self, spec: ModelSpec, num_assistant_tokens: int = NUM_ASSISTANT_TOKENS,
                 draft_noise: float = DRAFT_NOISE):
        super().__init__(spec)
        self.num_assistant_tokens = num_assistant_tokens
        self.own = self._assistant(pretrained(spec.path, spec.dtype), draft_noise)
        self.draft = self.own
        self._watch_rounds()

    def _watch_rounds(self) -> None:
        """Read each round from the target's forwards (a forward pre-hook): `acceptance()`'s steps per prompt."""
        self.steps: list[list[tuple[int, int]]] = []
        self._forwards: list[tuple[int, int]] = []  # (cached positions, tokens run) per target forward of a call
        self._counted = _positions_layer(self.spec.config)
        self.model.register_forward_pre_hook(self._record_forward, with_kwargs=True)

    def _assistant(self, model, noise: float = 0.0):
        """The draft on the device, perturbed by `noise`; its generation_config sets the burst (read by transformers'
        AssistedCandidateGenerator)."""
        model = model.to(self.spec.device).eval()
        if noise:
            perturb(model, noise, DRAFT_SEED)
        model.generation_config = GenerationConfig(
            num_assistant_tokens=self.num_assistant_tokens,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        return model

    def use_drafter(self, drafter: ModelSpec | None) -> None:
        """A draft checkpoint as the assistant from now on; None: the own (perturbed) one."""
        self.draft = self.own if drafter is None else self._assistant(pretrained(drafter.path, self.spec.dtype))

    def acceptance(self) -> list[list[tuple[int, int]]]:
        return self.steps

    def _record_forward(self, module, args, kwargs) -> None:
        cache = kwargs.get(cache_keyword())
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self._forwards.append((int(cache.get_seq_length(self._counted)) if cache is not None else 0, ids.shape[1]))

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        out, self.steps = [], []
        for prompt in prompts:
            self._forwards = []
            out += self._generate([prompt], max_new_tokens)
            self.steps.append(_rounds(self._forwards, len(prompt), len(prompt) + len(out[-1])))
        return out

    def _cache_kwargs(self) -> dict:
        return {"assistant_model": self.draft}


class HFPromptLookup(HFAssisted):
    """Prompt-lookup decoding: greedy ``generate(prompt_lookup_num_tokens=4)``. transformers'
    PromptLookupCandidateGenerator drafts, each round, the up to 4 tokens that followed the first earlier occurrence
    (left to right) of the sequence's last 2-gram, else of its last token (``max_matching_ngram_size=2``); no match: a
    round drafting nothing. The target checks them in one forward and its cache is cropped past the first rejected
    one, as in assisted generation (HFAssisted: same rounds, same ``acceptance()`` read from the target's forwards). The
    first round drafts from the prompt itself, before any token is generated. Batch size 1 (transformers' assisted
    generation); no scoring; nothing to take from the caller: the suite forces acceptance lengths through prompts whose
    lookup proposes a continuation it chose (suites/test_speculative.py: test_speculative_lookup).
    """

    kv_declaration = Declaration(
        kv_released=True,
        speculative=Speculative(k=NUM_ASSISTANT_TOKENS, drafters=(), acceptance=True, lookup=True),
        description=f"transformers generate(prompt_lookup_num_tokens={NUM_ASSISTANT_TOKENS}), greedy prompt-lookup "
                    "decoding (2-gram, then 1-gram lookup), DynamicCache",
        known_findings=(KnownFinding(
            "test_long_generation", Kind.OTHER,
            "transformers 5.24: prompt lookup drafts past max_length (PromptLookupCandidateGenerator caps the drafts' "
            "slice of the input, not the room left: up to 4 drafts one position before the end), so the verify forward "
            "runs positions beyond it; GPT-2's 512 absolute positions end there: IndexError in the position embedding "
            "on a generation to position 512 (docs/released-bugs.md)",
            models=("gpt2-abspos",), raised="IndexError",
        ),),
    )

    def __init__(self, spec: ModelSpec, num_tokens: int = NUM_ASSISTANT_TOKENS):
        HFEager.__init__(self, spec)  # no draft model: its rounds are read as HFAssisted's are
        self.num_tokens = num_tokens
        self._watch_rounds()

    def use_drafter(self, drafter: ModelSpec | None) -> None:
        raise TypeError("hf-prompt-lookup drafts by prompt lookup only: it takes no drafter (Speculative(drafters=()))")

    def _generation_config(self, max_new_tokens: int) -> GenerationConfig:
        config = super()._generation_config(max_new_tokens)
        config.prompt_lookup_num_tokens = self.num_tokens
        return config

    def _cache_kwargs(self) -> dict:
        return {}


def _positions_layer(config) -> int:
    """The first layer caching K/V (or a latent) per position, whose length is the positions cached: a recurrent
    layer's count is not one (transformers 5.25's linear-attention layers count their updates, not the tokens a
    verify forward ran)."""
    try:
        kinds = layer_caches(config)
    except (AttributeError, TypeError, IndexError):  # not a config whose layer kinds can be read
        return 0
    return next((c.layer for c in kinds if c.values > 0), 0)


def _rounds(forwards: list[tuple[int, int]], prompt: int, final: int) -> list[tuple[int, int]]:
    """(drafted, accepted) per assisted round from the target's forwards, (cached positions, tokens run) each: a round
    runs the positions from its start up to the sequence so far plus its drafts; the sequence after it is where the
    next one starts + 1 (the bonus token is not cached yet), after the last one the final length."""
    steps, length = [], prompt
    for i, (start, run) in enumerate(forwards):
        after = forwards[i + 1][0] + 1 if i + 1 < len(forwards) else final
        steps.append((start + run - length, after - length - 1))
        length = after
    return steps


class HFSlidingWindowCache(HFEager):
    """`generate()` with the cache class transformers built for windows: ``cache_implementation="sliding_window"``
    when every layer slides (Mistral), ``"hybrid"`` when sliding and global layers alternate (Gemma2/3).

    Before 4.56 these are their own classes (``SlidingWindowCache``: a ring of W slots; ``HybridCache``); from 4.56
    transformers maps both names to its static cache with sliding layers. The path of transformers #37574 (the oldest
    key dropped a step early) and of the prompt-longer-than-the-window size mismatch fixed in 4.53
    (docs/released-bugs.md). A model without sliding layers is not served (the cache would be a plain one).
    """

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_released=True,
        description='transformers generate(cache_implementation="sliding_window" | "hybrid"), eager',
    )

    def __init__(self, spec: ModelSpec):
        from pytest_kvcompile.models.zoo import sliding_layers

        sliding = sliding_layers(spec.config)
        if not sliding:
            raise ModelNotSupported(f"model '{spec.name}' has no sliding-window layer: its sliding-window cache "
                                    "would be a plain cache")
        super().__init__(spec)
        every = len(sliding) == spec.config.num_hidden_layers
        self.cache_implementation = "sliding_window" if every else "hybrid"

    def _cache_kwargs(self) -> dict:
        return {"cache_implementation": self.cache_implementation}


class _ForceTokens(LogitsProcessor):
    """Records each step's raw logits, then forces the next token of `tokens` (teacher forcing in generate())."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.rows: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = len(self.rows)
        self.rows.append(scores[0].float().cpu().clone())
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[step]] = 0.0
        return forced
