"""Find, parse and validate ``meridian.toml``; turn every problem into one readable ConfigError."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from meridian.config.boundaries import BUNDLED_MODELS
from meridian.config.files import MIB, read_user_file
from meridian.config.schema import MeridianConfig
from meridian.errors import ConfigError

CONFIG_FILE_NAME = "meridian.toml"
# A config is a few KiB; a megabyte of TOML is a mistake (or /dev/zero), not a config.
MAX_CONFIG_BYTES = MIB


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A validated config and where it came from (``None``: built-in defaults)."""

    config: MeridianConfig
    source: Path | None


def search_paths(cwd: Path | None = None, home: Path | None = None) -> list[Path]:
    """The implicit locations in order: ./meridian.toml, ~/.config/meridian/meridian.toml."""
    cwd = cwd if cwd is not None else Path.cwd()
    home = home if home is not None else Path.home()
    return [cwd / CONFIG_FILE_NAME, home / ".config" / "meridian" / CONFIG_FILE_NAME]


def load_config(
    path: str | Path | None = None, *, cwd: Path | None = None, home: Path | None = None
) -> LoadedConfig:
    """Load the config from ``path``, else the first search path that exists, else defaults.

    A file only overrides the fields it names. Raises :class:`ConfigError` for a missing
    explicit file, a path that is not a regular file (a directory, a device, a FIFO: named as
    what it is), one over :data:`MAX_CONFIG_BYTES`, malformed TOML (with file, line and column)
    or invalid values (dotted path). A search path that exists but is not a readable config
    file is an error too, not skipped.
    """
    if path is not None:
        explicit = Path(path)
        return LoadedConfig(parse_config_file(explicit), explicit)
    for candidate in search_paths(cwd, home):
        if candidate.exists() or candidate.is_symlink():
            return LoadedConfig(parse_config_file(candidate), candidate)
    return LoadedConfig(MeridianConfig(), None)


def parse_config_file(path: Path) -> MeridianConfig:
    """Parse and validate one TOML file (read bounded: :func:`~meridian.config.files.
    read_user_file`)."""
    text = read_user_file(path, what="config file", max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    return parse_config_text(text, source=str(path))


_TOML_POSITION = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def parse_config_text(text: str, *, source: str = "<string>") -> MeridianConfig:
    """Parse and validate TOML text; ``source`` names it in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_POSITION.match(str(exc))
        if match:
            raise ConfigError(
                f"{source}:{match['line']}:{match['col']}: malformed TOML: {match['msg']}"
            ) from None
        raise ConfigError(f"{source}: malformed TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(
            f"{source}: malformed TOML: arrays or inline tables nested too deeply"
        ) from None
    return validate_config(raw, source=source)


def validate_config(raw: dict[str, Any], *, source: str = "<config>") -> MeridianConfig:
    """Validate a parsed mapping; bundled model definitions fill fields a table leaves out."""
    merged = dict(raw)
    models = merged.get("model")
    if isinstance(models, dict):
        merged["model"] = {
            name: (
                {**BUNDLED_MODELS[name].model_dump(), **table}
                if name in BUNDLED_MODELS and isinstance(table, dict)
                else table
            )
            for name, table in models.items()
        }
    try:
        return MeridianConfig.model_validate(merged)
    except ValidationError as exc:
        lines = [format_validation_error(err) for err in exc.errors()]
        prefix = f"{source}: " if source else ""
        raise ConfigError(prefix + ("\n" + " " * len(prefix)).join(lines)) from None


_VALUE_ERROR_PREFIX = "Value error, "

# Fields a release removed, with what to do instead (an old file gets this, not "unknown").
REMOVED_FIELDS: dict[str, str] = {
    "kv_memory.think_phase_memory_fraction": (
        "the think-memory admission gate is gone: it existed only in the simulator, and the "
        "policy that ships is the one measured (docs/adr/0010-think-memory-gates-admission.md)"
    ),
    "kv_memory.aggressive_think_eviction": (
        "freeing a request's reasoning KV at </think> is gone: the answer attends over it "
        "(docs/adr/0011-one-policy-two-drivers.md)"
    ),
    "disagg": (
        "Meridian's KV pool and offload manager are retired; KV offload goes through vLLM's "
        "OffloadingConnector: use `meridian serve --kv-offload-gib N` instead "
        "(docs/adr/0014-kv-offload-through-vllm.md)"
    ),
}


def format_validation_error(
    err: ErrorDetails, *, unknown_hint: str = "check the spelling against meridian.toml.example"
) -> str:
    """One pydantic error as ``dotted.path must be ...; got VALUE`` (the config's, and every data
    file's: ``unknown_hint`` says where the known fields are listed).

    The schema has no union fields (``capacity_bytes`` uses a plain validator), so ``loc`` holds
    only section, field and table-key names and is the dotted path as it stands; a data file's
    list positions read ``entropy[2]``.
    """
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).removeprefix(
        "."
    )
    kind = err["type"]
    value = err["input"]
    msg = err["msg"].removeprefix(_VALUE_ERROR_PREFIX)
    if kind == "extra_forbidden":
        if path in REMOVED_FIELDS:
            return f"{path} was removed; delete it from the file: {REMOVED_FIELDS[path]}"
        return f"{path}: unknown field ({unknown_hint})"
    if kind == "missing":
        return f"{path}: required field is missing"
    if kind == "value_error" and "; got " in msg:
        # Cross-field (model validator) errors name their field and value; loc is the section.
        return f"{path}.{msg}" if path else msg
    if kind == "value_error":
        return f"{path} {msg}; got {shown(value)}"
    return f"{path}: {msg[0].lower() + msg[1:] if msg else msg}; got {shown(value)}"


# The most of a bad value an error line shows.
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` with its length when longer (a 3,000-character
    string in a config stays a one-line error).

    >>> shown("x" * 500)[-20:], len(shown("x" * 500))
    ('xxxxx... (500 chars)', 95)
    """
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value):,} chars" if isinstance(value, str) else f"{len(text):,} chars as text"
    return f"{text[:SHOWN_CHARS]}... ({size})"
