"""Meridian: phase-aware scheduling for reasoning models on vLLM."""

from importlib import metadata

# pyproject.toml holds the one version; an installed distribution (wheel or editable) carries it.
try:
    __version__ = metadata.version("vllm-meridian")
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
