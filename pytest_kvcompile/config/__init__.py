"""Configuration, below everything that runs: the option table and the run's `Settings` (`options`), the marker
table (`markers`) and the float32 tolerances with the near-tie budget rule (`tolerances`). Imports no torch and no
other pytest_kvcompile package, so every layer may read it (the layer order: tests/test_structure.py)."""
