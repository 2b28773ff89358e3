"""The pytest glue: options (`options`), per-process state (`session`), fixtures (`fixtures`), the engine
under test and its calls (`harness`), marker plumbing (`markers`) and the fuzzer (`fuzz`)."""
