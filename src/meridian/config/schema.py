"""The ``meridian.toml`` schema: one pydantic model per section.

Pydantic lives here, at the edge; the core copies the values it needs into plain attributes.
Every field carries its range in ``json_schema_extra["range"]`` so the docs can be generated
from this file, and every violation is reported as ``section.field must be ...; got VALUE``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, model_validator

from meridian.config.boundaries import BUNDLED_MODELS, ModelDefinition
from meridian.errors import ConfigError

# vLLM's gpu_memory_utilization default (vllm/config/cache.py, CacheConfig).
AUTO_CAPACITY_FRACTION = 0.92
U32_MAX = 2**32 - 1
# vLLM counts tokens in 32-bit integers (token positions, max_model_len): a think cap above this
# could never fire.
MAX_THINK_TOKENS = 2**31 - 1
# The largest KV block Meridian accepts, in tokens (vLLM's default is 16 on GPUs, 128 on CPUs;
# a block of 65,536 tokens of an 8B model is about 10 GB, more than a tenth of an H100).
MAX_BLOCK_SIZE_TOKENS = 2**16
# The largest KV cache Meridian accepts, in bytes: 4 TiB (4.4 TB). The largest single node today
# holds 8 x 288 GB = 2.3 TB of HBM (8 B300s, or 8 MI355Xs), weights included; 4 TiB leaves a margin
# of almost 2x. The simulator allocates per block (and vLLM's block pool a Python object each).
MAX_CAPACITY_BYTES = 2**42
# The longest RPDI window, in tokens: each thinking request holds a ring of one byte per window
# token, and RPDI fires only after two windows of chain, 131,072 think tokens at this bound, as
# long as the longest served contexts (128 Ki tokens) of reasoning models.
MAX_RPDI_WINDOW_TOKENS = 2**16
# The longest transition phrase, in characters: it is forced whole, one decode step a token,
# before `</think>` on every forced request, and spent from the request's max_tokens (with a
# tokenizer, ``meridian serve`` bounds it in tokens too: MAX_TRANSITION_TOKENS in
# meridian.vllm.runtime). A sentence such as vLLM's reasoning_end_str takes under 100.
MAX_TRANSITION_PHRASE_CHARS = 256


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _interval(lo: float | None, hi: float | None, *, lo_open: bool, hi_open: bool) -> Any:
    """A validator and doc string for a numeric range such as ``(0, 1]``."""
    left = "-inf" if lo is None else _num(lo)
    right = "inf" if hi is None else _num(hi)
    opening = "(" if lo_open or lo is None else "["
    closing = ")" if hi_open or hi is None else "]"
    text = f"{opening}{left}, {right}{closing}"

    def check(value: float) -> float:
        ok_lo = lo is None or (value > lo if lo_open else value >= lo)
        ok_hi = hi is None or (value < hi if hi_open else value <= hi)
        # inf and nan are outside every range ("inf" in a range is an open bound).
        if not (ok_lo and ok_hi) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"must be in {text}")
        return value

    return AfterValidator(check), text


def _field(default: Any, description: str, rng: str | None = None, **kw: Any) -> Any:
    extra: dict[str, Any] = {"range": rng} if rng else {}
    return Field(default=default, description=description, json_schema_extra=extra or None, **kw)


_POS_V, _POS = _interval(0, None, lo_open=True, hi_open=True)
_GE1_V, _GE1 = _interval(1, None, lo_open=False, hi_open=True)
_GT1_V, _GT1 = _interval(1, None, lo_open=True, hi_open=True)
_UNIT_OC_V, _UNIT_OC = _interval(0, 1, lo_open=True, hi_open=False)
_U64_V, _U64 = _interval(0, None, lo_open=False, hi_open=True)
_U32P_V, _U32P = _interval(1, U32_MAX, lo_open=False, hi_open=False)
_THINK_CAP_V, _ = _interval(1, MAX_THINK_TOKENS, lo_open=False, hi_open=False)
_BLOCK_V, _BLOCK = _interval(1, MAX_BLOCK_SIZE_TOKENS, lo_open=False, hi_open=False)
_BLOCK_BYTES_V, _BLOCK_BYTES = _interval(1, MAX_CAPACITY_BYTES // 2, lo_open=False, hi_open=False)
_RPDI_WINDOW_V, _RPDI_WINDOW = _interval(1, MAX_RPDI_WINDOW_TOKENS, lo_open=False, hi_open=False)
_PACE_V, _PACE = _interval(0, 10_000, lo_open=False, hi_open=False)
# Latency budgets in ms: a microsecond to an hour (a denormal budget rounds to 0 s).
_BUDGET_MS_V, _BUDGET_MS = _interval(0.001, 3_600_000, lo_open=False, hi_open=False)
_RESERVE_V, _RESERVE = _interval(0, 0.5, lo_open=False, hi_open=False)
_WAIT_WEIGHT_V, _WAIT_WEIGHT = _interval(0, 1_000_000, lo_open=False, hi_open=False)

PosFloat = Annotated[float, _POS_V]
PaceMs = Annotated[float, _PACE_V]
BudgetMs = Annotated[float, _BUDGET_MS_V]
ReserveFraction = Annotated[float, _RESERVE_V]
WaitWeight = Annotated[float, _WAIT_WEIGHT_V]
AtLeastOneFloat = Annotated[float, _GE1_V]
AboveOneFloat = Annotated[float, _GT1_V]
UnitOpenClosed = Annotated[float, _UNIT_OC_V]
U64 = Annotated[int, _U64_V]
PosU32 = Annotated[int, _U32P_V]
ThinkCap = Annotated[int, _THINK_CAP_V]
BlockTokens = Annotated[int, _BLOCK_V]
BlockBytes = Annotated[int, _BLOCK_BYTES_V]
RpdiWindow = Annotated[int, _RPDI_WINDOW_V]


def _auto_or_int(minimum: int, message: str, maximum: int | None = None) -> PlainValidator:
    """A validator for ``"auto"`` or an integer (not a bool) in ``[minimum, maximum]``."""

    def check(value: object) -> int | Literal["auto"]:
        if value == "auto":
            return "auto"
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= minimum
            and (maximum is None or value <= maximum)
        ):
            return value
        raise ValueError(message)

    return PlainValidator(check)


CapacityBytes = Annotated[
    int | Literal["auto"],
    _auto_or_int(
        1,
        f'must be "auto" or a number of bytes in [1, {MAX_CAPACITY_BYTES}] (4 TiB: the largest '
        "single node today holds 2.3 TB of HBM)",
        MAX_CAPACITY_BYTES,
    ),
]
BudgetRows = Annotated[
    int | Literal["auto"],
    _auto_or_int(0, 'must be "auto" or a number of rows >= 0 (0: the whole batch)'),
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, frozen=True)


class SchedulerConfig(_Section):
    """``[scheduler]``: the dual-queue policy and the think-token budget limits."""

    think_tpot_budget_ms: BudgetMs = _field(
        80.0, "Per-token latency a think-phase request tolerates (ms).", _BUDGET_MS
    )
    output_tpot_budget_ms: BudgetMs = _field(
        20.0, "Target inter-token latency of answer streams (ms); the output SLO.", _BUDGET_MS
    )
    think_batch_multiplier: AtLeastOneFloat = _field(
        2.5, "Think rows per step may be up to this multiple of the output budget.", _GE1
    )
    max_think_tokens: ThinkCap = _field(
        32768,
        "Hard cap: `</think>` is forced at this many think tokens.",
        f"(min_think_tokens, {MAX_THINK_TOKENS}]",
    )
    min_think_tokens: U64 = _field(
        512, "Floor: no entropy-driven force before this many think tokens.", _U64
    )
    think_starvation_steps: PosU32 = _field(
        8, "A think request deferred this many consecutive steps is served.", _U32P
    )
    output_budget_rows: BudgetRows = _field(
        0,
        "Rows per step that keep answer streams within output_tpot_budget_ms; think rows fill "
        "up to think_batch_multiplier x this. 0: the whole batch (no deferral; the default: "
        "deferring cost up to 3 % TTFVT and throughput at 90-100 % load and TTFT above "
        'capacity, benchmarks/results/output-budget-off.md); "auto": derived from the decode '
        "step times the engine measures (no deferral until a step is over budget).",
        '"auto" or [0, inf)',
    )
    admission: Literal["headroom", "vllm"] = _field(
        "headroom",
        '"headroom": start a waiting request only while the running requests\' KV, grown as '
        "requests like them grew, still fits the cache (fewer preemptions and less recompute "
        "under load); before requests have finished, and in small caches, while the requests' "
        "own bounds (prompt plus max_tokens) fit, if the bounds are tight; "
        '"vllm": vLLM\'s own admission (whenever the prompt fits).',
    )
    admission_order: Literal["chat-first", "arrival", "reasoning-first"] = _field(
        "chat-first",
        'Which waiting requests start first: "chat-first": new chat requests (no reasoning '
        "left: the shortest expected reasoning first) before new reasoning requests; "
        '"arrival": vLLM\'s order (first come, first served); "reasoning-first": new reasoning '
        "requests first. Preempted requests stay at the head; see admission_order_max_wait_s.",
    )
    admission_order_max_wait_s: PosFloat = _field(
        30.0,
        "The starvation bound of admission_order: a request that has waited this many seconds "
        "is not passed over any more (it starts in its arrival order, before newer requests).",
        _POS,
    )
    admission_reserve: ReserveFraction = _field(
        0.01,
        "Headroom admission keeps this fraction of the KV cache out of its projection (the "
        "projected peak is a mean; the real one lies above it about half the time).",
        _RESERVE,
    )
    admission_wait_weight: WaitWeight = _field(
        0.0,
        "Cost-based admission on top of headroom's projection: a waiting request the projection "
        "holds starts anyway once its wait so far times this weight is at least the expected "
        "cost of the preemptions it risks (its projected overflow over the engine's prefill "
        "rate, plus the time a victim would wait to restart; both learnt from the engine's own "
        "steps). 0: off (the projection alone decides); larger: waiting weighs more (a "
        "deployment that streams the reasoning feels every second of it).",
        _WAIT_WEIGHT,
    )
    answer_pace_ms: PaceMs = _field(
        0.0,
        "Pace answer streams: skip an answer stream for a step while it would still get its "
        "next token within this many ms of its last (give the step's time to thinking "
        "requests); 0: serve every answer stream every step.",
        _PACE,
    )
    preempt_max_fraction: UnitOpenClosed = _field(
        0.25, "At most this fraction of the running set is preempted in one step.", _UNIT_OC
    )
    force_transition_phrase: str = _field(
        "",
        "Text forced before `</think>` when the budget fires (like vLLM's reasoning_end_str), "
        "so the answer starts from a closing sentence; it counts as think tokens. Empty: "
        "`</think>` alone. It must not contain a think marker of any model family (bundled or "
        "`[model.NAME]`): Meridian adds the marker itself. At most "
        f"{MAX_TRANSITION_PHRASE_CHARS} characters (and, where the tokenizer is known, 64 "
        "tokens): it is forced whole, a decode step a token, before every forced answer, and "
        "spent from the request's max_tokens.",
        f"at most {MAX_TRANSITION_PHRASE_CHARS} characters",
        max_length=MAX_TRANSITION_PHRASE_CHARS,
    )

    @model_validator(mode="after")
    def _think_bounds(self) -> SchedulerConfig:
        if self.max_think_tokens <= self.min_think_tokens:
            raise ValueError(
                f"max_think_tokens must be greater than scheduler.min_think_tokens "
                f"({self.min_think_tokens}); got {self.max_think_tokens}"
            )
        return self


class EntropyConfig(_Section):
    """``[entropy]``: EAT (convergence) and RPDI (overthinking) signals."""

    enabled: bool = _field(True, "Entropy-driven forcing; when false only the hard cap forces.")
    ema_alpha: UnitOpenClosed = _field(0.05, "EMA smoothing factor of the EAT signal.", _UNIT_OC)
    rpdi_threshold: AboveOneFloat = _field(
        3.0, "Overthinking when recent/whole-chain transition rate exceeds this.", _GT1
    )
    eat_ema_variance_threshold: PosFloat = _field(
        0.001, "Converged when the EAT EMA variance falls below this (nats^2).", _POS
    )
    transition_entropy_threshold: PosFloat = _field(
        2.5, "A token whose entropy exceeds this (nats) is a transition token.", _POS
    )
    eat_probe_interval_tokens: PosU32 = _field(32, "Think tokens between two EAT samples.", _U32P)
    eat_min_distance: PosU32 | None = _field(
        None, "EAT samples before a convergence stop may fire; default ceil(2 / ema_alpha).", _U32P
    )
    rpdi_window_tokens: RpdiWindow = _field(
        256,
        "Recent window (tokens) of the RPDI ratio; it needs 2 windows of chain to fire. At most "
        f"{MAX_RPDI_WINDOW_TOKENS}: every thinking request holds a byte a window token, and a "
        "longer window could fire only past the longest served contexts (128 Ki tokens).",
        _RPDI_WINDOW,
    )

    @model_validator(mode="after")
    def _eat_distance_fits(self) -> EntropyConfig:
        if self.eat_min_distance is None and 2.0 / self.ema_alpha > U32_MAX:
            raise ValueError(
                f"ema_alpha must be at least {2.0 / U32_MAX:.3g} without entropy.eat_min_distance "
                f"(its default, ceil(2 / ema_alpha) samples, must fit 32 bits); got "
                f"{self.ema_alpha!r}"
            )
        return self

    @property
    def effective_eat_min_distance(self) -> int:
        """``eat_min_distance`` or, when unset, ``ceil(2 / ema_alpha)``."""
        if self.eat_min_distance is not None:
            return self.eat_min_distance
        return math.ceil(2.0 / self.ema_alpha - 1e-9)


class KvMemoryConfig(_Section):
    """``[kv_memory]``: the KV cache's block shape and capacity."""

    block_size_bytes: BlockBytes = _field(
        16384, "Bytes of one KV block (two must fit the largest capacity_bytes).", _BLOCK_BYTES
    )
    block_size_tokens: BlockTokens = _field(
        16,
        "Tokens of one KV block (vLLM's default: 16 on GPUs, 128 on CPUs; at most 65536, a "
        "block of 65,536 tokens of an 8B model is about 10 GB).",
        _BLOCK,
    )
    capacity_bytes: CapacityBytes = _field(
        "auto",
        "KV capacity in bytes, or \"auto\": 92% of the device's memory (vLLM's "
        "gpu_memory_utilization default); the simulator takes the model's weights out. At most "
        f"{MAX_CAPACITY_BYTES} (4 TiB): the largest single node today holds 8 x 288 GB = 2.3 TB "
        "of HBM (B300, MI355X), weights included; the margin is almost 2x.",
        f'"auto" or [2 x block_size_bytes, {MAX_CAPACITY_BYTES}]',
    )

    @model_validator(mode="after")
    def _capacity_holds_blocks(self) -> KvMemoryConfig:
        need = 2 * self.block_size_bytes
        if self.capacity_bytes != "auto" and self.capacity_bytes < need:
            raise ValueError(
                f"capacity_bytes must hold at least 2 blocks of kv_memory.block_size_bytes "
                f"({need} bytes); got {self.capacity_bytes}"
            )
        return self

    def resolve_capacity_bytes(self, device_memory_bytes: int | None) -> int:
        """The capacity in bytes; ``"auto"`` needs the device's memory size.

        >>> KvMemoryConfig(capacity_bytes=1 << 20).resolve_capacity_bytes(None)
        1048576
        """
        if self.capacity_bytes != "auto":
            return self.capacity_bytes
        if device_memory_bytes is None or device_memory_bytes <= 0:
            raise ConfigError(
                'kv_memory.capacity_bytes is "auto" but no device memory size is known here; '
                "set kv_memory.capacity_bytes to a number of bytes"
            )
        return int(device_memory_bytes * AUTO_CAPACITY_FRACTION)


class TelemetryConfig(_Section):
    """``[telemetry]``: Prometheus metrics and optional OTLP export."""

    prometheus: bool = _field(True, "Register Meridian's metrics on the Prometheus registry.")
    otlp_enabled: bool = _field(False, "Export spans and metrics over OTLP/HTTP (the otel extra).")
    otlp_endpoint: str = _field(
        "http://127.0.0.1:4318",
        "OTLP/HTTP collector base URL (http:// or https:// and a host; checked when otlp_enabled).",
    )

    @model_validator(mode="after")
    def _endpoint_is_a_url(self) -> TelemetryConfig:
        if self.otlp_enabled and not _is_http_url(self.otlp_endpoint):
            raise ValueError(
                "otlp_endpoint must be an http:// or https:// URL with a host when "
                f"telemetry.otlp_enabled is true; got {self.otlp_endpoint!r}"
            )
        return self


def _is_http_url(text: str) -> bool:
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class MeridianConfig(_Section):
    """The whole ``meridian.toml``."""

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    entropy: EntropyConfig = Field(default_factory=EntropyConfig)
    kv_memory: KvMemoryConfig = Field(default_factory=KvMemoryConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    model: dict[str, ModelDefinition] = Field(
        default_factory=dict,
        description="Model families by name; bundled definitions are merged underneath.",
    )

    @model_validator(mode="after")
    def _phrase_has_no_marker(self) -> MeridianConfig:
        phrase = self.scheduler.force_transition_phrase
        for marker in sorted({m for d in self.all_models().values() for m in d.markers}):
            if marker in phrase:
                families = ", ".join(
                    name for name, d in sorted(self.all_models().items()) if marker in d.markers
                )
                raise ValueError(
                    f"scheduler.force_transition_phrase must not contain {marker!r}, a think "
                    f"marker of {families} (the phrase is forced before the think-end marker, "
                    f"which Meridian adds itself); got {phrase!r}"
                )
        return self

    def model_definition(self, name: str) -> ModelDefinition:
        """The named model definition (a ``[model.NAME]`` table or a bundled one)."""
        models = self.all_models()
        if name not in models:
            known = ", ".join(sorted(models))
            raise ConfigError(
                f"unknown model family {name!r}; known: {known}. Define its boundaries in a "
                f"[model.{name}] table (think_start, think_end, reasoning_parser)"
            )
        return models[name]

    def all_models(self) -> dict[str, ModelDefinition]:
        """Bundled model definitions overlaid with the file's ``[model.*]`` tables."""
        return {**BUNDLED_MODELS, **self.model}
