"""Compile recording and its marker: the one adapter to torch's and transformers' private APIs (`hooks`), the
recorder and its verdict (`recorder`), and ``@pytest.mark.no_recompile`` with the ``kv_compile_recorder`` fixture
(`marker`)."""
