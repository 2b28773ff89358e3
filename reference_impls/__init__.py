"""Reference engines: short, direct implementations the conformance suite is checked against (gpt-fast style).

- `model`: Llama / Mistral and the shared pieces: RoPE, attention mask, `KVCache.update`, the layer loop.
- `gemma3`, `gemma4`, `gpt2`: what each architecture changes; `loader`: the `ARCHITECTURES` table, `load_model`.
- `compile`: private torch.compile per engine, unbacked dynamic sizes, left padding; `engine`: the greedy loop.
- `bamba`, `qwen3_next`: Mamba2 and Gated DeltaNet hybrids, their recurrent layers' `model.State` beside K/V (engines
  keeping states only); `recurrent`: what their scans share.
- One module per cache strategy: `compiled_dynamic`, `chunked_prefill`, `sliding_window`, `kv_shared`, `static_cache`,
  `eviction_engine` (its rules are the checker's, pytest_kvcompile/oracles/eviction.py).

This package depends on the plugin (`pytest_kvcompile`), never the reverse: the plugin names these engines
only in its built-in registry (`contract.registry.BUILTIN_ENGINES`).
"""
