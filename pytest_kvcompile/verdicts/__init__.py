"""Verdict data, below everything that measures or reports: failure kinds and their facts (`failures`), the
per-engine-and-model rows of a run and the run rules over them (`rows`). Imports no torch."""
