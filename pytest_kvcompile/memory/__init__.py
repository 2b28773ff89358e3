"""Memory: what an engine holds and its KV layout's footprint (`measure`), and
``@pytest.mark.limit_memory`` (`marker`)."""
