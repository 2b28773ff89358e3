"""llama.cpp's own server (``llama-server``, C++), managed: ``llama-cpp-server`` (docs/engines/llama-cpp-server.md).

The engine converts the checkpoint to the float32 GGUF of the ``llama-cpp`` adapter (engines/llamacpp.py: `convert`,
the ``gguf`` package), starts ``llama-server`` on it on a free 127.0.0.1 port with `SLOTS` parallel slots of
`llamacpp.N_CTX` positions each (continuous batching and prompt caching are its defaults), and speaks its
``/completion`` API (engines/server.py: token-array prompts, ``n_probs``, ``cache_prompt``, ``return_tokens``; no
prompt log-probabilities, so the teacher-forced check is skipped).

``llama-server`` is not on PyPI: the binary is found in ``$LLAMA_SERVER``, else on PATH (build it from llama.cpp:
``cmake -B build -DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server``). llama-cpp-python's own
server (its ``[server]`` extra) cannot stand in: its ``/v1/completions`` takes text prompts only (``prompt: str |
list[str]`` in llama_cpp/server/types.py, 0.3.36), which a GGUF without a vocabulary cannot tokenize.

Declared like ``llama-cpp``: CPU, float32, its default f16 KV cache (``kv_cache_dtype="float16"``).
"""

from __future__ import annotations

import os
import shutil

import torch

from pytest_kvcompile.contract.engine import Declaration, ModelSpec
from pytest_kvcompile.engines.llamacpp import N_CTX, convert
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.engines.server_process import Launch, ManagedServer

SLOTS = 8  # parallel sequences (the concurrency suite sends 8 at once)
BINARY_ENV = "LLAMA_SERVER"
RECIPE = Recipe(
    packages=("gguf==0.19.0",),
    note="llama-server (llama.cpp's C++ server) is not a pip package: build it from llama.cpp (cmake -B build "
    "-DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server) and put it on PATH or in $LLAMA_SERVER; "
    "the venv only needs gguf, which writes the GGUF (docs/engines/llama-cpp-server.md).",
)
REQUIRES = RECIPE.requirement("gguf")


class LlamaCppServer(ManagedServer):
    """``llama-server -m <float32 GGUF> --parallel SLOTS``, greedy over ``POST /completion``."""

    kv_declaration = Declaration(
        batching=True, isolated=False, thread_safe=True, devices=("cpu",), dtypes=("float32",), requires=REQUIRES,
        kv_cache_dtype="float16",
        description="llama.cpp's llama-server (managed, 127.0.0.1), /completion over a float32 GGUF, KV cache f16, "
        f"{SLOTS} slots of {N_CTX} positions",
    )

    def launch(self, spec: ModelSpec, port: int) -> Launch:
        binary = os.environ.get(BINARY_ENV) or shutil.which("llama-server")
        if not binary:
            raise FileNotFoundError(f"llama-server not found (${BINARY_ENV} is unset and it is not on PATH): "
                                    f"{RECIPE.note}")
        gguf = convert(spec, vocabulary=True)  # the server detokenizes what it generates: a vocabulary of none aborts
        threads = str(max(1, torch.get_num_threads()))
        return Launch([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel",
                       str(SLOTS), "-c", str(SLOTS * N_CTX), "-t", threads, "-tb", threads, "--no-webui"], "llamacpp",
                      env={}, ready_timeout=120)


__all__ = ["RECIPE", "REQUIRES", "LlamaCppServer"]
