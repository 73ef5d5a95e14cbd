"""Checkpoint files below the model classes: GGUF files read into folders (gguf.py), models built
from a recipe on first use (build.py)."""
