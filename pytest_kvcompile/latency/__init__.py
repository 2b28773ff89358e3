"""Latency: how prefill and decode are timed (`measure`), and ``@pytest.mark.latency_budget`` with the
``kv_latency`` fixture (`marker`)."""
