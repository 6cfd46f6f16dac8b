"""What ``meridian serve`` will open, checked before it starts vLLM: the model (a directory with
a model in it, a GGUF file, or a Hugging Face id) and the port (a port number that can be bound on
its host now); and the line every check of :mod:`meridian.vllm.doctor` prints, :class:`Check`.

A check never raises for what it finds: it returns a :class:`Check` that says what is wrong and
how to fix it, so ``meridian doctor`` finishes every check and ``meridian serve`` stops with one
line instead of a vLLM traceback at start-up.
"""

from __future__ import annotations

import enum
import errno
import json
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meridian.config.files import MIB, kind_of, read_user_file
from meridian.errors import MeridianError
from meridian.vllm.serve import bind_address, flag_value

__all__ = ["Check", "Status", "check_model", "check_port", "is_cached"]


class Status(enum.Enum):
    """A check's outcome; a ``FAIL`` stops ``meridian serve`` and makes ``doctor`` exit 1."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the checklist: ``name``, what was found, and what to do about it."""

    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The check as printed: ``STATUS  name: detail`` (and the fix on the next line)."""
        text = f"{self.status.value}  {self.name}: {self.detail}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


def check_port(vllm_args: Sequence[str]) -> Check:
    """The port vLLM will listen on is a port number, and it can be bound on its host now (the
    host is this machine's, the port is free and allowed): bound and released here, with
    ``SO_REUSEADDR`` as vLLM binds it."""
    name = "port"
    try:
        host, port = bind_address(vllm_args)
    except MeridianError as exc:
        return Check(Status.FAIL, name, str(exc))
    try:
        number = int(port)
    except ValueError:
        return Check(Status.FAIL, name, f"--port {port!r} is not a number", "pass --port N")
    if not 0 <= number <= MAX_PORT:
        return Check(
            Status.FAIL, name, f"--port {number} is outside [0, {MAX_PORT}]", "pass --port N"
        )
    where = f"{host}:{number}"
    try:
        _bind_once(host, number)
    except socket.gaierror as exc:
        return Check(Status.FAIL, name, f"--host {host} does not resolve: {exc.strerror}")
    except OSError as exc:
        why, fix = _BIND_ERRORS.get(
            exc.errno or 0, (exc.strerror or str(exc), "pass another --host or --port")
        )
        return Check(Status.FAIL, name, f"{where} cannot be bound: {why}", fix)
    return Check(Status.PASS, name, f"{where} is free")


def _bind_once(host: str, port: int) -> None:
    """Bind ``host:port`` (its first address) as vLLM does, and release it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


MAX_PORT = 65535
# Why a bind fails, and what to do, by errno.
_BIND_ERRORS: dict[int, tuple[str, str]] = {
    errno.EADDRINUSE: (
        "in use (another server listens there)",
        "stop that server, or pass --port N for a free port",
    ),
    errno.EADDRNOTAVAIL: (
        "the host is not an address of this machine",
        "pass --host with one of this machine's addresses, or leave --host out",
    ),
    errno.EACCES: (
        "permission denied (ports below 1024 need privileges)",
        "pass --port 1024 or above",
    ),
}


def check_model(model: str | None, vllm_args: Sequence[str]) -> Check:
    """``--model`` is what vLLM can load: a directory with a model in it (``config.json``,
    weights, a tokenizer), a GGUF file, or a Hugging Face model id (vLLM fetches it)."""
    name = "model"
    if model is None:
        return Check(Status.WARN, name, "no --model: the checks below decide for a stand-in")
    path = Path(model).expanduser()
    if path.exists() or path.is_symlink():
        return _model_path_check(path, vllm_args)
    if not is_hub_id(model):
        return Check(
            Status.FAIL,
            name,
            f"{model}: no such file or directory, and not a Hugging Face model id (name or "
            "namespace/name)",
            "pass the directory that holds the model (its config.json), or a hub id such as "
            "Qwen/Qwen3-8B",
        )
    if is_cached(model, "config.json"):
        return Check(Status.PASS, name, f"{model} (a hub id, in the Hugging Face cache here)")
    return Check(
        Status.WARN,
        name,
        f"{model}: not a directory here; a hub id, not in the Hugging Face cache: vLLM fetches "
        "it at start-up",
        "without the hub, download it first and pass its directory",
    )


# A Hugging Face model id, as huggingface_hub's validate_repo_id has it: "name" or
# "namespace/name", word characters, "-" and ".", without "--" or "..".
_HUB_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")


def is_hub_id(model: str) -> bool:
    """Whether vLLM would take ``model`` (not a local path) for a Hugging Face model id.

    >>> is_hub_id("Qwen/Qwen3-8B"), is_hub_id("/nonexistent/model"), is_hub_id("./m")
    (True, False, False)
    """
    return bool(_HUB_ID.match(model)) and "--" not in model and ".." not in model


# Weight files vLLM loads (safetensors, PyTorch, GGUF), and what stands in for them.
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A model's config.json is a few KiB.
MAX_MODEL_CONFIG_BYTES = 16 * MIB


def _model_path_check(path: Path, vllm_args: Sequence[str]) -> Check:
    name = "model"
    if path.is_file() and path.suffix == ".gguf":
        return Check(Status.PASS, name, f"{path} (a GGUF file)")
    if not path.is_dir():
        kind = kind_of(path)
        what = "a broken symlink" if kind == "missing" else kind
        return Check(
            Status.FAIL,
            name,
            f"{path} is {what}, not a model directory",
            "pass the directory that holds the model's config.json",
        )
    config = path / "config.json"
    fix = "pass the directory that holds the model's config.json, weights and tokenizer"
    try:
        text = read_user_file(config, what="model config", max_bytes=MAX_MODEL_CONFIG_BYTES)
        if not isinstance(json.loads(text), dict):
            raise MeridianError(f"{config} is not a JSON object")
    except MeridianError as exc:
        missing = not (config.exists() or config.is_symlink())
        detail = f"{path} holds no config.json: no model in it" if missing else str(exc)
        return Check(Status.FAIL, name, detail, fix)
    except (json.JSONDecodeError, RecursionError) as exc:
        return Check(Status.FAIL, name, f"{config} is not JSON: {exc}", fix)
    found = ["config.json"]
    if flag_value(vllm_args, "--load-format") != "dummy":
        if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
            return Check(
                Status.FAIL,
                name,
                f"{path} holds no weights ({', '.join(_WEIGHTS)})",
                "pass the directory with the weights, or --load-format dummy for random ones",
            )
        found.append("weights")
    skip = "--skip-tokenizer-init" in vllm_args
    if not skip and flag_value(vllm_args, "--tokenizer") is None:
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            return Check(
                Status.FAIL,
                name,
                f"{path} holds no tokenizer ({', '.join(_TOKENIZER_FILES)})",
                "pass --tokenizer DIR, or put the tokenizer files beside config.json",
            )
        found.append("tokenizer")
    return Check(Status.PASS, name, f"{path} ({', '.join(found)})")


def is_cached(model: str, filename: str) -> bool:
    """Whether ``filename`` of ``model`` is on this machine (a local directory or the Hugging
    Face cache), without asking the hub."""
    if Path(model).is_dir():
        return (Path(model) / filename).is_file()
    try:
        from huggingface_hub import (  # type: ignore[import-not-found,unused-ignore]
            try_to_load_from_cache,
        )
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(model, filename), str)
    except ValueError:  # HFValidationError: not a hub id (a path that does not exist)
        return False
