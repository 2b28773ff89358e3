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
"""

from __future__ import annotations

import logging

from pytest_kvcompile.contract.engine import Declaration, ModelSpec
from pytest_kvcompile.engines.recipe import Recipe

RECIPE = Recipe(packages=("transformers>=5.23",),
                note="continuous batching is transformers' own (init_continuous_batching, ContinuousBatchingConfig).")
NUM_BLOCKS = 32  # the paged cache's blocks (pages of 256 positions per layer): 8,192 positions, sized here
MAX_BATCH_TOKENS = 1024  # tokens in one forward
MAX_NEW_TOKENS = 512  # the manager's generation config: the most any request may ask (the suites ask for <= 64)


class ContinuousBatching:
    """transformers continuous batching (``init_continuous_batching``: a persistent manager, paged KV cache), greedy."""

    kv_declaration = Declaration(
        batching=True,
        dtypes=("float32", "bfloat16", "float16"),
        requires=RECIPE.requirement("transformers"),
        description="transformers continuous batching: one persistent manager, paged KV cache (paged|eager)",
    )

    def __init__(self, spec: ModelSpec):
        from pytest_kvcompile.models.checkpoints import pretrained

        self.spec = spec
        self.model = pretrained(spec.path, spec.dtype,
                                                          attn_implementation="eager").to(spec.device).eval()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its per-call info and warnings

    def _started(self):
        """The model's manager, started: built at the first call, then the one kept on the model by the last call's
        ``stop(keep_for_next_session=True)``, with its paged cache."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        sizes = ContinuousBatchingConfig(num_blocks=NUM_BLOCKS, max_batch_tokens=MAX_BATCH_TOKENS)
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
