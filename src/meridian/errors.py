"""Errors a user can act on. Every Meridian error derives from :class:`MeridianError`."""

from __future__ import annotations


class MeridianError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(MeridianError):
    """A configuration file or value is invalid; the message names the dotted field path."""


class BoundaryError(MeridianError):
    """Think-boundary tokens could not be resolved from a tokenizer, or disagree with the config."""
