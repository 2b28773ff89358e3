"""The engine contract and registry: what an engine is (`engine`), how a NAME resolves to one (`registry`),
and the validated calls the harness makes into it (`engine_io`)."""
