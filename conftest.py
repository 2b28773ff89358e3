"""Repository-wide test setup: offline Hugging Face, pytester for the plugin's own tests."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

pytest_plugins = ["pytester"]
