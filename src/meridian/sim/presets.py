"""Named hardware and model presets for the roofline step-time model.

The values live in ``data/presets.toml``, each with a ``source`` citation (datasheet, or the
model's ``config.json`` field names); this module only loads and validates them.

Example::

    from meridian.sim.presets import hardware_preset, model_preset
    from meridian.sim.steptime import RooflineStepTime

    roofline = RooflineStepTime(hardware_preset("h100-sxm"), model_preset("llama-3-8b"))
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from importlib import resources
from typing import Any, TypeVar

from meridian.errors import ConfigError
from meridian.sim.steptime import HardwareSpec, ModelSpec

__all__ = [
    "HARDWARE",
    "MODELS",
    "VLLM_DEFAULTS",
    "VllmDefaults",
    "hardware_preset",
    "load_presets",
    "model_preset",
    "vllm_defaults",
]

_PRESETS_FILE = "presets.toml"


@dataclasses.dataclass(frozen=True, slots=True)
class VllmDefaults:
    """What vLLM's API server picks on a device when the user sets nothing."""

    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    source: str


_Spec = TypeVar("_Spec", HardwareSpec, ModelSpec, VllmDefaults)


def _build(cls: type[_Spec], section: str, name: str, table: Any) -> _Spec:
    """One preset from its TOML table; every field but ``name`` must be given, with its type."""
    where = f"{_PRESETS_FILE}: {section}.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table")
    fields = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "name"}
    missing = sorted(set(fields) - set(table))
    unknown = sorted(set(table) - set(fields))
    if missing or unknown:
        raise ConfigError(
            f"{where}: missing {', '.join(missing) or 'nothing'}; "
            f"unknown {', '.join(unknown) or 'nothing'}"
        )
    values: dict[str, Any] = {}
    for key, annotation in fields.items():
        value = table[key]
        # The annotations are strings (``from __future__ import annotations``).
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "str": isinstance(value, str),
        }[str(annotation)]
        if not ok:
            raise ConfigError(f"{where}.{key} must be {annotation}; got {value!r}")
        values[key] = float(value) if annotation == "float" else value
    return cls(name=name, **values)


def load_presets(
    text: str,
) -> tuple[dict[str, HardwareSpec], dict[str, ModelSpec], dict[str, VllmDefaults]]:
    """Parse a presets TOML document (``[hardware.<name>]``, ``[model.<name>]`` and
    ``[vllm_defaults.<hardware name>]`` tables)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{_PRESETS_FILE}: {exc}") from None
    unknown = sorted(set(document) - {"hardware", "model", "vllm_defaults"})
    if unknown:
        raise ConfigError(
            f"{_PRESETS_FILE}: unknown table(s) {', '.join(unknown)}; "
            "expected hardware, model, vllm_defaults"
        )
    hardware = {
        name: _build(HardwareSpec, "hardware", name, table)
        for name, table in document.get("hardware", {}).items()
    }
    models = {
        name: _build(ModelSpec, "model", name, table)
        for name, table in document.get("model", {}).items()
    }
    defaults = {
        name: _build(VllmDefaults, "vllm_defaults", name, table)
        for name, table in document.get("vllm_defaults", {}).items()
    }
    missing = sorted(set(hardware) - set(defaults))
    if missing:
        raise ConfigError(f"{_PRESETS_FILE}: no [vllm_defaults] for {', '.join(missing)}")
    return hardware, models, defaults


HARDWARE: dict[str, HardwareSpec]
MODELS: dict[str, ModelSpec]
VLLM_DEFAULTS: dict[str, VllmDefaults]
HARDWARE, MODELS, VLLM_DEFAULTS = load_presets(
    (resources.files("meridian.sim") / "data" / _PRESETS_FILE).read_text(encoding="utf-8")
)


def hardware_preset(name: str) -> HardwareSpec:
    """The hardware preset called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ConfigError(
            f"unknown hardware preset {name!r}; known: {', '.join(sorted(HARDWARE))}"
        ) from None


def model_preset(name: str) -> ModelSpec:
    """The model preset called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(MODELS))}"
        ) from None


def vllm_defaults(hardware: str) -> VllmDefaults:
    """vLLM's defaults on the hardware preset called ``hardware``."""
    hardware_preset(hardware)  # the error for an unknown name
    return VLLM_DEFAULTS[hardware]
