"""Models and prompts: the built-in tiny zoo (`zoo`), the run's model catalogue (`checkpoints`), and the
prompt sets (`prompts`)."""
