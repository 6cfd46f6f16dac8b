"""What both sides of the integration derive from the engine: config, model family, boundaries.

The scheduler runs in vLLM's engine-core process and the logits processors in the worker
processes; nothing is shared between them. Each side calls :func:`runtime_from_vllm_config` on
the ``VllmConfig`` it was built with and arrives at the same :class:`MeridianRuntime`, because
the inputs are the same: the ``meridian.toml`` named by ``$MERIDIAN_CONFIG`` (else the usual
search paths), the model family named by ``$MERIDIAN_MODEL`` (else auto-detected) and the
engine's own tokenizer. Environment variables are inherited by vLLM's spawned processes, which
is why they, and not Python globals, carry the choice.

Model family (first rule that applies):

1. ``$MERIDIAN_MODEL`` names a bundled family or a ``[model.NAME]`` table: its boundaries must
   resolve in the tokenizer, else :class:`~meridian.errors.BoundaryError` (the user asked for it).
2. Otherwise every known family whose ``reasoning_parser`` matches vLLM's
   ``--reasoning-parser`` is tried, then the generic ``<think>``/``</think>`` pair; the first
   whose boundaries resolve (configured ids agreeing) wins. The generic pair must be two single
   tokens of the vocabulary: spelling ``<think>`` out of BPE pieces is not a boundary.
3. Nothing resolves: a model without reasoning. Every request is single-phase OUTPUT, so
   Meridian orders nothing and forces nothing; a warning says how to define the boundaries.

Per-request knobs travel in ``SamplingParams.extra_args`` (:func:`parse_request_budget`).
This module imports neither torch nor vllm at import time.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from meridian.config import (
    BoundaryIds,
    MeridianConfig,
    ModelDefinition,
    load_config,
    resolve_boundary_ids,
)
from meridian.config.boundaries import TokenizerLike
from meridian.core.budget import RequestBudget, Signals
from meridian.core.format import ReasoningFormat
from meridian.core.interface import output_budget_setting
from meridian.errors import BoundaryError, ConfigError, MeridianError

__all__ = [
    "ENV_CONFIG",
    "ENV_MODEL",
    "ENV_OUTPUT_BUDGET_ROWS",
    "GENERIC_THINK_TAGS",
    "KNOB_FORCING",
    "KNOB_MAX_THINK_TOKENS",
    "KNOB_SIGNALS",
    "MeridianRuntime",
    "RequestArgsError",
    "forbids_forced_tokens",
    "output_budget_rows",
    "parse_request_budget",
    "resolve_runtime",
    "runtime_from_vllm_config",
    "transition_ids",
]

logger = logging.getLogger(__name__)

ENV_CONFIG = "MERIDIAN_CONFIG"
ENV_MODEL = "MERIDIAN_MODEL"
KNOB_MAX_THINK_TOKENS = "meridian_max_think_tokens"
KNOB_FORCING = "meridian_forcing"
KNOB_SIGNALS = "meridian_signals"
_KNOBS = (KNOB_MAX_THINK_TOKENS, KNOB_FORCING, KNOB_SIGNALS)
_KNOB_SET = frozenset(_KNOBS)
_FORCING_VALUES: Mapping[str, bool] = {"on": True, "off": False}
_SIGNALS_BY_VALUE: Mapping[object, Signals] = {s.value: s for s in Signals}

# The auto-detection fallback: <think>/</think> as special tokens, wherever a model has them.
GENERIC_THINK_TAGS = ModelDefinition(
    think_start="<think>", think_end="</think>", reasoning_parser="deepseek_r1"
)
GENERIC_NAME = "think_tags"


class RequestArgsError(MeridianError, ValueError):
    """A ``meridian_*`` key of ``SamplingParams.extra_args`` is unknown or has a bad value.

    A ``ValueError``, so that vLLM's ``validate_params`` turns it into an HTTP 400 for that
    request only (offline: an exception from ``LLM.generate``).
    """


@dataclass(frozen=True, slots=True)
class MeridianRuntime:
    """The config and the model's reasoning boundaries, as one side of the engine sees them.

    ``boundaries`` is ``None`` for a model without reasoning (``model.has_boundaries`` false).
    ``reason`` says in words how the model family was chosen (for logs and ``meridian serve``).
    ``transition_ids`` are ``scheduler.force_transition_phrase`` in the model's tokens: forced
    before ``think_end`` when the budget fires (``()``: none).
    """

    config: MeridianConfig
    config_source: Path | None
    model_name: str
    format: ReasoningFormat
    boundaries: BoundaryIds | None
    reason: str
    transition_ids: tuple[int, ...] = ()

    @property
    def think_end_ids(self) -> tuple[int, ...]:
        """The token ids that close the think phase (``()`` without reasoning)."""
        return self.format.think_end

    def request_budget(
        self, params: Any, on_restricted: Callable[[], None] | None = None
    ) -> RequestBudget | None:
        """The budget of a request with these ``SamplingParams``: its ``meridian_*`` knobs
        (:func:`parse_request_budget`, whose :class:`RequestArgsError` it raises), with forcing
        off when the client's own ``allowed_token_ids`` or ``bad_words`` forbid a token a force
        would emit (:func:`forbids_forced_tokens`; ``on_restricted()`` is called then): the
        client's restriction wins. The logits processor (what it forces) and the scheduler
        (which forces it infers from the tokens) both read a request's budget here.
        """
        budget = parse_request_budget(getattr(params, "extra_args", None))
        if (budget is not None and not budget.forcing) or not self.format.has_boundaries:
            return budget
        allowed = getattr(params, "allowed_token_ids", None)
        bad_words = getattr(params, "bad_words_token_ids", None)
        if not (allowed or bad_words) or not forbids_forced_tokens(
            (*self.transition_ids, *self.format.think_end), allowed, bad_words
        ):
            return budget
        if on_restricted is not None:
            on_restricted()
        if budget is None:
            return _request_budget(None, False, Signals.ALL)
        return _request_budget(budget.max_think_tokens, False, budget.signals)


def forbids_forced_tokens(
    forced: Sequence[int],
    allowed_token_ids: Sequence[int] | None,
    bad_words_token_ids: Sequence[Sequence[int]] | None,
) -> bool:
    """Whether a client's restrictions forbid a token of ``forced`` (what a force emits, in
    order: the transition phrase, then ``think_end``).

    ``allowed_token_ids`` forbids every token it does not list. A bad word (its token ids, as
    vLLM's ``SamplingParams.bad_words_token_ids`` holds them) bans its last token wherever the
    output ends with the rest of it: it may ban forced token ``j`` when it ends with that token
    and the rest of it agrees with the forced tokens before ``j`` as far as they go (before
    them come the model's own tokens, which may match the remainder).

    >>> forbids_forced_tokens((9,), None, [[9]]), forbids_forced_tokens((9,), [1, 2], None)
    (True, True)
    >>> forbids_forced_tokens((5, 6, 9), None, [[7, 9]])  # "…7 9" never ends a force
    False
    """
    if allowed_token_ids and not set(allowed_token_ids).issuperset(forced):
        return True
    for word in bad_words_token_ids or ():
        if not word:
            continue
        *rest, last = word
        for j, token in enumerate(forced):
            k = min(j, len(rest))
            if token == last and list(forced[j - k : j]) == rest[len(rest) - k :]:
                return True
    return False


def _vocab(tokenizer: TokenizerLike | None) -> Mapping[str, int]:
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, Mapping):
        return tokenizer
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return get_vocab() if callable(get_vocab) else {}


def resolve_runtime(
    tokenizer: TokenizerLike | None,
    *,
    config: MeridianConfig | None = None,
    config_source: Path | None = None,
    model_name: str | None = None,
    reasoning_parser: str = "",
) -> MeridianRuntime:
    """Pick the model family and resolve its boundaries (rules in the module docstring).

    ``tokenizer`` is a ``{token: id}`` mapping or a tokenizer (``get_vocab``/``encode``);
    ``None`` when vLLM skips tokenizer init, in which case only configured ids can be used.
    Raises :class:`~meridian.errors.ConfigError` for an unknown ``model_name`` or a
    transition phrase that cannot be used, and :class:`~meridian.errors.BoundaryError` when
    the named family does not resolve.
    """
    cfg = config if config is not None else MeridianConfig()
    runtime = _resolve_family(tokenizer, cfg, config_source, model_name, reasoning_parser)
    phrase = cfg.scheduler.force_transition_phrase
    if not phrase or not runtime.format.has_boundaries:
        return runtime
    return replace(runtime, transition_ids=transition_ids(phrase, tokenizer, runtime.format))


# The longest transition phrase in tokens (scheduler.force_transition_phrase's character bound,
# MAX_TRANSITION_PHRASE_CHARS, is the tokenizer-free half): 64 forced steps add about 1.3 s before
# the first answer token at the default 20 ms answer budget.
MAX_TRANSITION_TOKENS = 64


def transition_ids(
    phrase: str, tokenizer: TokenizerLike | None, model: ReasoningFormat
) -> tuple[int, ...]:
    """``phrase`` in the model's tokens, checked to be usable before ``think_end``."""
    field = "scheduler.force_transition_phrase"
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise ConfigError(
            f"{field} needs the model's tokenizer to encode it, and this engine has none "
            "(skip_tokenizer_init); remove the phrase or start vLLM with its tokenizer"
        )
    ids = tuple(int(i) for i in encode(phrase, add_special_tokens=False))
    end = model.think_end
    if not ids:
        raise ConfigError(f"{field}: {phrase!r} encodes to no tokens")
    if len(ids) > MAX_TRANSITION_TOKENS:
        raise ConfigError(
            f"{field} must be at most {MAX_TRANSITION_TOKENS} tokens of this model's tokenizer "
            f"(it is forced whole, a decode step a token, before every forced answer); got "
            f"{len(ids)} tokens for {phrase!r}"
        )
    if any(ids[i : i + len(end)] == end for i in range(len(ids) - len(end) + 1)):
        raise ConfigError(
            f"{field}: {phrase!r} contains the think-end marker; the phrase is forced before "
            "it, so leave the marker out"
        )
    return ids


def _resolve_family(
    tokenizer: TokenizerLike | None,
    cfg: MeridianConfig,
    config_source: Path | None,
    model_name: str | None,
    reasoning_parser: str,
) -> MeridianRuntime:
    if model_name:
        definition = cfg.model_definition(model_name)
        if tokenizer is None:
            from meridian.config import configured_boundary_ids

            ids = configured_boundary_ids(definition, name=model_name)
        else:
            ids = resolve_boundary_ids(definition, tokenizer, name=model_name)
        return _runtime(cfg, config_source, model_name, definition, ids, f"${ENV_MODEL}")

    vocab = _vocab(tokenizer)
    candidates = [
        (name, d)
        for name, d in cfg.all_models().items()
        if reasoning_parser and d.reasoning_parser == reasoning_parser
    ]
    for name, definition in candidates:
        try:
            ids = resolve_boundary_ids(definition, tokenizer if tokenizer is not None else vocab)
        except BoundaryError:
            continue
        reason = f"reasoning parser {reasoning_parser!r}"
        return _runtime(cfg, config_source, name, definition, ids, reason)
    tags = GENERIC_THINK_TAGS
    if tags.think_start in vocab and tags.think_end in vocab:
        # A plain mapping: no encode() fallback, so BPE pieces of "<think>" never count.
        ids = resolve_boundary_ids(tags, dict(vocab), name=GENERIC_NAME)
        reason = "<think>/</think> are single tokens of the vocabulary"
        return _runtime(cfg, config_source, GENERIC_NAME, tags, ids, reason)
    logger.warning(
        "Meridian: no think boundaries found in this model's tokenizer (reasoning parser %r); "
        "every request is treated as a plain answer stream, so Meridian changes nothing. "
        "Set $%s to a model family, or define [model.NAME] (think_start, think_end, "
        "reasoning_parser) in meridian.toml",
        reasoning_parser,
        ENV_MODEL,
    )
    return MeridianRuntime(
        cfg, config_source, "none", ReasoningFormat.without_reasoning(), None, "no boundaries"
    )


def _runtime(
    cfg: MeridianConfig,
    source: Path | None,
    name: str,
    definition: ModelDefinition,
    ids: BoundaryIds,
    reason: str,
) -> MeridianRuntime:
    return MeridianRuntime(
        cfg, source, name, ReasoningFormat.from_boundaries(definition, ids), ids, reason
    )


def runtime_from_vllm_config(vllm_config: Any) -> MeridianRuntime:
    """The runtime for an engine: config from ``$MERIDIAN_CONFIG``, tokenizer from vLLM.

    Raises :class:`~meridian.errors.ConfigError` / :class:`~meridian.errors.BoundaryError`
    for a bad config file or an explicitly named family that does not fit the model.
    """
    loaded = load_config(os.environ.get(ENV_CONFIG) or None)
    model_config = vllm_config.model_config
    tokenizer: Any = None
    if not getattr(model_config, "skip_tokenizer_init", False):
        from vllm.tokenizers import (  # type: ignore[import-not-found,unused-ignore]
            cached_tokenizer_from_config,
        )

        tokenizer = cached_tokenizer_from_config(model_config)
    structured = getattr(vllm_config, "structured_outputs_config", None)
    parser = str(getattr(structured, "reasoning_parser", "") or "")
    return resolve_runtime(
        tokenizer,
        config=loaded.config,
        config_source=loaded.source,
        model_name=os.environ.get(ENV_MODEL) or None,
        reasoning_parser=parser,
    )


def parse_request_budget(
    extra_args: Mapping[str, Any] | None, *, field: str = "extra_args"
) -> RequestBudget | None:
    """The per-request budget from ``SamplingParams.extra_args``; ``None`` when none is set.
    Errors name the knob as ``field.KEY`` (``vllm_xargs`` at the HTTP front door).

    Keys: ``meridian_max_think_tokens`` (a positive int: replaces the hard cap for this
    request), ``meridian_forcing`` (``"on"``/``"off"``, a bool, or 0/1, what vLLM's HTTP
    server makes of a JSON bool; off disables every force, hard cap included) and
    ``meridian_signals`` (``"all"``, ``"eat"``, ``"rpdi"`` or ``"none"``: which entropy signals
    may force the request; the hard cap always may). Any other
    ``meridian_*`` key is a typo and an error; keys without the prefix belong to others and are
    ignored.

    >>> parse_request_budget({"meridian_max_think_tokens": 64})
    RequestBudget(max_think_tokens=64, forcing=True)
    """
    if not extra_args:
        return None
    # Parsed once per request by the scheduler and twice by the logits processor: no generator
    # or enum scan here, and only keys outside the knobs are looked at one by one.
    keys = extra_args.keys()
    if not keys <= _KNOB_SET:
        unknown = [k for k in keys if k.startswith("meridian_") and k not in _KNOB_SET]
        if unknown:
            raise RequestArgsError(
                f"{field}: unknown Meridian key {min(unknown)!r}; known keys: {', '.join(_KNOBS)}"
            )
        if keys.isdisjoint(_KNOB_SET):
            return None
    cap = extra_args.get(KNOB_MAX_THINK_TOKENS)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise RequestArgsError(
            f"{field}.{KNOB_MAX_THINK_TOKENS} must be a positive integer; got {cap!r}"
        )
    raw = extra_args.get(KNOB_FORCING, "on")
    if isinstance(raw, bool):
        forcing: bool | None = raw
    elif isinstance(raw, int) and raw in (0, 1):
        # vLLM's HTTP server turns a JSON bool in vllm_xargs into 0/1 before we see it.
        forcing = bool(raw)
    else:
        forcing = _FORCING_VALUES.get(str(raw).lower())
    if forcing is None:
        raise RequestArgsError(f'{field}.{KNOB_FORCING} must be "on", "off" or a bool; got {raw!r}')
    raw_signals = extra_args.get(KNOB_SIGNALS, "all")
    try:
        signals = _SIGNALS_BY_VALUE.get(raw_signals)
    except TypeError:  # unhashable: no signal's value
        signals = None
    if signals is None:
        names = ", ".join(f'"{s.value}"' for s in Signals)
        raise RequestArgsError(
            f"{field}.{KNOB_SIGNALS} must be one of {names}; got {raw_signals!r}"
        )
    return _request_budget(cap, forcing, signals)


@functools.lru_cache(maxsize=256)
def _request_budget(cap: int | None, forcing: bool, signals: Signals) -> RequestBudget:
    """One shared (immutable) :class:`RequestBudget` per distinct knob setting."""
    return RequestBudget(max_think_tokens=cap, forcing=forcing, signals=signals)


# Rows per step that keep answer streams within scheduler.output_tpot_budget_ms: the config's
# scheduler.output_budget_rows, overridden by this variable (it reaches the engine-core process
# like $MERIDIAN_CONFIG). "auto": measured (meridian.core.output_budget); 0: the whole batch.
ENV_OUTPUT_BUDGET_ROWS = "MERIDIAN_OUTPUT_BUDGET_ROWS"


def output_budget_rows(configured: int | Literal["auto"]) -> int | Literal["auto"] | None:
    """The output budget in force: ``scheduler.output_budget_rows`` (``configured``) unless
    ``$MERIDIAN_OUTPUT_BUDGET_ROWS`` overrides it; rows, ``None`` (the whole batch) or
    ``"auto"``."""
    raw = os.environ.get(ENV_OUTPUT_BUDGET_ROWS, "").strip()
    if not raw:
        return output_budget_setting(configured)
    if raw == "auto":
        return "auto"
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ConfigError(
            f'${ENV_OUTPUT_BUDGET_ROWS} must be "auto" or a number of rows >= 0; got {raw!r}'
        )
    return output_budget_setting(rows)
