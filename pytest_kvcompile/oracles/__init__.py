"""Oracles and token matching: the Hugging Face eager oracle and the dispatch by strategy (`hf`), the
reference store that caches and self-checks references (`store`), and the comparison of an engine's
tokens with a reference (`token_match`)."""
