"""transformers continuous batching (``model.generate_batch``: a paged KV cache in blocks, requests of different
lengths scheduled together; what ``transformers serve`` runs) as the engine ``hf-continuous-batching``.

Rules:

- One model and one continuous-batching manager per engine object, kept between calls as ``transformers serve`` keeps
  one: the model is loaded with ``attn_implementation="eager"`` (the manager switches it to its ``paged|eager``
  kernel); the manager is built by ``model.init_continuous_batching(GenerationConfig(do_sample=False,
  max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None), ContinuousBatchingConfig(...))`` at the first call, started for
  each call and stopped after it with ``keep_for_next_session=True``, which keeps it (and its paged cache) on the
  model for the next call. Stopped because its generation thread is not a daemon: a manager left running keeps the
  process from exiting (measured: the check-engine run's pytest wrote its reports, then never exited).
  ``eos_token_id=None`` is continuous batching's "no stop token", so each request gets exactly the tokens it asks
  for.
- Every ``generate`` adds its prompts as requests (``add_requests(prompts, max_new_tokens=N)``) and waits for each
  to finish; results are taken by request id in the prompts' order. A failed request (``GenerationOutput.error``)
  raises with transformers' message; a call that never finishes is ``--kv-call-timeout``'s to stop.
- ``batching=True``: the prompts go in together and the scheduler decides what runs in one forward (chunked
  prefill, decode of other requests beside it). The paged cache and its blocks outlive each call: what one call
  leaves is what the stale-state and call-history suites look for.
- No ``score()``: continuous batching has no teacher-forced path. No ``kv_cache_bytes``: the paged cache is sized by
  the manager and shared by every request.
- The paged cache is sized here (``ContinuousBatchingConfig(num_blocks=NUM_BLOCKS, max_batch_tokens=...)``), not by
  the manager: on CPU with ``psutil`` installed it takes 90% of the free RAM per manager (``max_memory_percent``),
  and a session of engine objects ran this 24 GiB machine out of memory (measured: the kernel killed the run).
- The first call costs seconds on CPU (the manager's set-up), later ones about 0.3 s (its thread's start and stop).
- ``hf-continuous-batching-prefix-cache``: the same manager with pages of ``PREFIX_PAGE`` positions and
  ``PREFIX_BLOCKS`` blocks. Its prefix caching is transformers' default (``allow_block_sharing=True``: full blocks
  hashed over the whole prefix, shared by later requests and kept cached after theirs end, all of them evicted when
  free blocks run short); with pages of 256 the suite's prompts hardly ever fill one, with 16 they do, and 2,048
  positions are few enough for the prefix suite to overflow. transformers shares blocks only on models whose layers
  are all full attention (``PagedAttentionCache.use_prefix_sharing``); on the others the engine runs unshared.
"""

from __future__ import annotations

import dataclasses
import logging

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec, PrefixCache
from pytest_kvcompile.engines.recipe import Recipe

RECIPE = Recipe(packages=("transformers>=5.23",),
                note="continuous batching is transformers' own (init_continuous_batching, ContinuousBatchingConfig).")
NUM_BLOCKS = 32  # the paged cache's blocks (pages of 256 positions per layer): 8,192 positions, sized here
MAX_BATCH_TOKENS = 1024  # tokens in one forward
MAX_NEW_TOKENS = 512  # the manager's generation config: the most any request may ask (the long generations: 505)
PREFIX_PAGE, PREFIX_BLOCKS = 16, 128  # hf-continuous-batching-prefix-cache: 2,048 positions in blocks of 16


class ContinuousBatching:
    """transformers continuous batching (``init_continuous_batching``: a persistent manager, paged KV cache), greedy."""

    kv_declaration = Declaration(
        batching=True,
        dtypes=("float32", "bfloat16", "float16"),
        requires=RECIPE.requirement("transformers"),
        description="transformers continuous batching: one persistent manager, paged KV cache (paged|eager)",
    )
    #: ContinuousBatchingConfig's sizes (and options) for this engine's manager
    cache_config: dict = {"num_blocks": NUM_BLOCKS, "max_batch_tokens": MAX_BATCH_TOKENS}

    def __init__(self, spec: ModelSpec):
        from pytest_kvcompile.models.checkpoints import pretrained

        self.spec = spec
        _pages(spec)
        self.model = pretrained(spec.path, spec.dtype, attn_implementation="eager").to(spec.device).eval()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its per-call info and warnings

    def _started(self):
        """The model's manager, started: built at the first call, then the one kept on the model by the last call's
        ``stop(keep_for_next_session=True)``, with its paged cache."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        sizes = ContinuousBatchingConfig(**spelled_for(self.cache_config, ContinuousBatchingConfig))
        manager = self.model.init_continuous_batching(generation_config=config, continuous_batching_config=sizes)
        manager.start()
        return manager

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]
        manager = self._started()
        try:
            ids = manager.add_requests(inputs=[list(p) for p in prompts], max_new_tokens=max_new_tokens)
            done: dict = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("the continuous batching manager stopped before serving every request "
                                       f"({len(done)} of {len(ids)} finished)")
        finally:  # its thread is not a daemon: left running, it would keep the process from exiting
            manager.stop(block=True, keep_for_next_session=True)
        failed = [done[i].error for i in ids if done[i].error is not None]
        if failed:
            raise RuntimeError(f"continuous batching failed a request: {failed[0]}")
        return [list(done[i].generated_tokens) for i in ids]


def _pages(spec: ModelSpec) -> None:
    """ModelNotSupported where transformers' paged cache has no allocator for one of the model's layer types (a
    hybrid model's recurrent layers, in 5.24): asked of transformers itself, so a version that pages them runs."""
    import transformers

    try:
        from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
    except ImportError:  # another layout of the package: the manager itself says what it refuses
        return
    try:
        group_layers_by_attn_type(spec.config)
    except ValueError as exc:
        raise ModelNotSupported(
            f"transformers {transformers.__version__}'s continuous batching pages only the layer types it has an "
            f"allocator for ({exc}); model '{spec.name}' has layer types "
            f"{sorted(set(getattr(spec.config, 'layer_types', None) or []))}"
        ) from None


def spelled_for(options: dict, config_class) -> dict:
    """`options` as `config_class` (ContinuousBatchingConfig) names them: before transformers 5.17 a page was called
    ``block_size``."""
    import inspect

    if "page_size" in options and "page_size" not in inspect.signature(config_class).parameters:
        return {("block_size" if name == "page_size" else name): value for name, value in options.items()}
    return options


class ContinuousBatchingPrefixCache(ContinuousBatching):
    """The same with blocks of PREFIX_PAGE positions and PREFIX_BLOCKS of them: transformers' prefix caching (block
    sharing, its default) within reach of the suite's prompts, and a pool the prefix suite overflows."""

    kv_declaration = dataclasses.replace(
        ContinuousBatching.kv_declaration,
        description=f"transformers continuous batching, prefix caching (allow_block_sharing) in {PREFIX_BLOCKS} blocks "
                    f"of {PREFIX_PAGE} positions",
        prefix_cache=PrefixCache(capacity_tokens=PREFIX_BLOCKS * PREFIX_PAGE, block_size=PREFIX_PAGE),
    )
    cache_config: dict = {"page_size": PREFIX_PAGE, "num_blocks": PREFIX_BLOCKS, "max_batch_tokens": MAX_BATCH_TOKENS,
                          "allow_block_sharing": True}

    def _started(self):
        self.manager = super()._started()
        return self.manager

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The base engine's; then the pool transformers built is read back (its blocks of whole-model pages): another
        size than declared is an error. ``shares_prefixes``: whether transformers turned block sharing on here."""
        out = super().generate(prompts, max_new_tokens)
        built = getattr(getattr(self, "manager", None), "batch_processor", None)  # none before a first request
        if built is not None:
            self.shares_prefixes = built.cache.use_prefix_sharing
            if built.cache.num_blocks != PREFIX_BLOCKS:
                raise RuntimeError(f"transformers built a paged cache of {built.cache.num_blocks} blocks, not the "
                                   f"{PREFIX_BLOCKS} this engine declares (PrefixCache(capacity_tokens="
                                   f"{PREFIX_BLOCKS * PREFIX_PAGE}))")
        return out
