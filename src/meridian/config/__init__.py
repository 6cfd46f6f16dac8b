"""Configuration: the ``meridian.toml`` schema, loading, and per-model boundary definitions."""

from meridian.config.boundaries import (
    BUNDLED_MODELS,
    BoundaryIds,
    ModelDefinition,
    TokenizerJsonVocab,
    configured_boundary_ids,
    resolve_boundary_ids,
)
from meridian.config.loading import LoadedConfig, load_config, parse_config_text, validate_config
from meridian.config.schema import (
    EntropyConfig,
    KvMemoryConfig,
    MeridianConfig,
    SchedulerConfig,
    TelemetryConfig,
)

__all__ = [
    "BUNDLED_MODELS",
    "BoundaryIds",
    "EntropyConfig",
    "KvMemoryConfig",
    "LoadedConfig",
    "MeridianConfig",
    "ModelDefinition",
    "SchedulerConfig",
    "TelemetryConfig",
    "TokenizerJsonVocab",
    "configured_boundary_ids",
    "load_config",
    "parse_config_text",
    "resolve_boundary_ids",
    "validate_config",
]
