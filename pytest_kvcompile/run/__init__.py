"""The pytest glue: per-process state (`session`), fixtures (`fixtures`), the engine under test and its calls
(`harness`, `isolation`), the fuzzer (`fuzz`) and test grouping (`grouping`). Options and the marker table live
below, in `pytest_kvcompile.config`."""
