"""Oracles and token matching: the Hugging Face eager oracle and the dispatch by strategy (`hf`), the
eviction oracle and its policies, the checker's definition of correct eviction (`eviction`), the reference
store that caches and self-checks references (`store`), what every oracle returns (`reference`) and the
comparison of an engine's tokens with a reference (`token_match`). The float32 tolerances live in
`pytest_kvcompile.config.tolerances`."""
