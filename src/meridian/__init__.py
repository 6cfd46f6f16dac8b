"""Meridian: phase-aware scheduling for reasoning models on vLLM."""

__version__ = "0.1.0"
