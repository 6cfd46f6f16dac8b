"""Step-time models (roofline, fitted), presets, and the output-budget search."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meridian.errors import ConfigError
from meridian.sim.presets import HARDWARE, MODELS, hardware_preset, load_presets, model_preset
from meridian.sim.steptime import (
    CSV_COLUMNS,
    BatchShape,
    Bound,
    CalibrationError,
    FittedStepTime,
    HardwareSpec,
    ModelSpec,
    RooflineStepTime,
    StepTimeModel,
)

H100_LLAMA = RooflineStepTime(hardware_preset("h100-sxm"), model_preset("llama-3-8b"))
EMPTY = BatchShape(num_prefill_tokens=0, num_decode_seqs=0, num_kv_tokens_read=0, num_seqs=0)
# A fitted model with every coefficient non-zero, as if calibrated on some GPU.
FITTED = FittedStepTime(
    base_ns=1_500_000.0,
    ns_per_prefill_token=40_000.0,
    ns_per_decode_seq=30_000.0,
    ns_per_kv_token=2.5,
    ns_per_seq=15_000.0,
)
ALL_ROOFLINES = [
    RooflineStepTime(HARDWARE[hw], MODELS[m]) for hw in sorted(HARDWARE) for m in sorted(MODELS)
]


# --- roofline against hand arithmetic (h100-sxm + llama-3-8b) ---------------------------------


def test_roofline_decode_only_batch_is_memory_bound_by_hand() -> None:
    # 64 decode rows at context 1024: 65,536 KV tokens read.
    batch = BatchShape.decode_only(64, 1024)
    weight_bytes = 8_030_261_248 * 2  # 16,060,522,496 B of bf16 weights
    kv_bytes = 65_536 * (2 * 32 * 8 * 128 * 2)  # 65,536 tokens x 131,072 B = 8,589,934,592 B
    memory_s = (weight_bytes + kv_bytes) / (3.35e12 * 0.8)  # 24,650,457,088 B / 2.68e12 B/s
    assert memory_s == pytest.approx(9.197932e-3, rel=1e-6)
    linear_flops = 2 * 8_030_261_248 * 64  # 1.0279e12
    attention_flops = 4 * 32 * 32 * 128 * 65_536  # each row attends its 1024 tokens: 3.436e10
    compute_s = (linear_flops + attention_flops) / (989.4e12 * 0.5)
    assert compute_s == pytest.approx(2.147227e-3, rel=1e-6)
    overhead_ns = 1_000_000 + 64 * 20_000  # 2.28 ms
    expected_ns = round(memory_s * 1e9) + overhead_ns  # memory roof wins: 11.477932 ms

    assert H100_LLAMA.step_time_ns(batch) == expected_ns == 11_477_932
    parts = H100_LLAMA.breakdown(batch)
    assert parts["bound"] is Bound.MEMORY and parts["bound"].value == "memory"
    assert parts["memory_s"] == pytest.approx(memory_s)
    assert parts["compute_s"] == pytest.approx(compute_s)
    assert parts["overhead_s"] == pytest.approx(2.28e-3)


def test_roofline_large_prefill_is_compute_bound_by_hand() -> None:
    # One fresh 8192-token prompt: causal attention over itself, c (c + 1) / 2 pairs.
    batch = BatchShape(
        num_prefill_tokens=8192, num_decode_seqs=0, num_kv_tokens_read=8192, num_seqs=1
    )
    linear_flops = 2 * 8_030_261_248 * 8192  # 1.31568e14
    pairs = 8192 * 8193 // 2  # 33,558,528 = kv read (8192) + 8192 * 8191 / 2
    attention_flops = 4 * 32 * 32 * 128 * pairs  # 524,288 FLOP per pair: 1.75944e13
    compute_s = (linear_flops + attention_flops) / (989.4e12 * 0.5)  # / 4.947e14 FLOP/s
    assert compute_s == pytest.approx(0.3015204, rel=1e-6)
    memory_s = (8_030_261_248 * 2 + 8192 * 131_072) / (3.35e12 * 0.8)  # 17.13e9 B: 6.39 ms
    assert memory_s < compute_s
    expected_ns = round(compute_s * 1e9) + 1_000_000 + 1 * 20_000

    assert H100_LLAMA.step_time_ns(batch) == expected_ns
    assert H100_LLAMA.step_time_ns(batch) == pytest.approx(302.540e6, rel=1e-5)
    assert H100_LLAMA.breakdown(batch)["bound"] is Bound.COMPUTE


def test_roofline_counts_decode_rows_attention_exactly_and_prefill_causally() -> None:
    per_pair = 4 * 32 * 32 * 128
    per_token = 2 * 8_030_261_248
    mixed = BatchShape(
        num_prefill_tokens=100, num_decode_seqs=10, num_kv_tokens_read=50_100, num_seqs=11
    )
    pairs = 50_100 + 100 * 99 // 2
    assert H100_LLAMA.flops(mixed) == pytest.approx(per_token * 110 + per_pair * pairs)
    assert H100_LLAMA.bytes_read(mixed) == 8_030_261_248 * 2 + 50_100 * 131_072


# --- contract shared by every model -------------------------------------------------------------


@pytest.mark.parametrize("model", [*ALL_ROOFLINES, FITTED], ids=lambda m: m.label)
def test_empty_batch_costs_nothing(model: StepTimeModel) -> None:
    assert model.step_time_ns(EMPTY) == 0


def test_empty_batch_breakdown_is_zero() -> None:
    parts = H100_LLAMA.breakdown(EMPTY)
    assert (parts["compute_s"], parts["memory_s"], parts["overhead_s"]) == (0.0, 0.0, 0.0)


@st.composite
def batches(draw: st.DrawFn) -> BatchShape:
    """A valid batch: decode rows, prefill requests splitting the prefill tokens, any context."""
    num_decode = draw(st.integers(0, 512))
    num_prefill = draw(st.integers(0, 16_384))
    num_prefill_requests = draw(st.integers(1, min(num_prefill, 64))) if num_prefill else 0
    extra_context = draw(st.integers(0, 2_000_000))
    return BatchShape(
        num_prefill_tokens=num_prefill,
        num_decode_seqs=num_decode,
        num_kv_tokens_read=num_prefill + num_decode + extra_context,
        num_seqs=num_decode + num_prefill_requests,
    )


FIELDS = ["num_prefill_tokens", "num_decode_seqs", "num_kv_tokens_read", "num_seqs"]


@settings(max_examples=400, deadline=None)
@given(
    batch=batches(),
    field=st.sampled_from(FIELDS),
    delta=st.integers(1, 100_000),
    model=st.sampled_from([*ALL_ROOFLINES, FITTED]),
)
def test_step_time_is_monotone_in_every_dimension(
    batch: BatchShape, field: str, delta: int, model: StepTimeModel
) -> None:
    try:
        bigger = dataclasses.replace(batch, **{field: getattr(batch, field) + delta})
    except ValueError:
        assume(False)  # the bump broke a BatchShape invariant: not a batch the engine can send
        raise
    assert model.step_time_ns(bigger) >= model.step_time_ns(batch)
    assert model.step_time_ns(batch) > 0 or batch.is_empty


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((-1, 0, 0, 0), ">= 0"),
        ((0, 3, 3, 2), "num_decode_seqs <= num_seqs"),
        ((5, 0, 5, 6), r"num_seqs <= num_decode_seqs \+ num_prefill_tokens"),
        ((5, 2, 7, 2), "no prefill request"),
        ((0, 4, 3, 4), "num_kv_tokens_read"),
    ],
)
def test_batch_shape_rejects_inconsistent_counts(counts: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchShape(*counts)


# --- presets -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B
        ("qwen3-8b", 2 * 36 * 8 * 128 * 2),  # 147,456 B
        ("r1-distill-qwen-7b", 2 * 28 * 4 * 128 * 2),  # 57,344 B
        ("qwen3-32b", 2 * 64 * 8 * 128 * 2),  # 262,144 B
    ],
)
def test_kv_bytes_per_token_of_each_preset_follows_the_formula(name: str, expected: int) -> None:
    model = model_preset(name)
    formula = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.bytes_per_param
    assert model.kv_bytes_per_token == formula == expected
    assert model.weight_bytes == model.num_params * 2


def test_presets_carry_the_brief_constants_and_a_source() -> None:
    assert set(HARDWARE) == {"h100-sxm", "a100-sxm-80g", "l4"}
    assert set(MODELS) == {"llama-3-8b", "qwen3-8b", "r1-distill-qwen-7b", "qwen3-32b"}
    gib = 1024**3
    h100, a100, l4 = HARDWARE["h100-sxm"], HARDWARE["a100-sxm-80g"], HARDWARE["l4"]
    assert (h100.peak_flops, h100.hbm_bandwidth, h100.memory_bytes) == (989.4e12, 3.35e12, 80 * gib)
    assert (a100.peak_flops, a100.hbm_bandwidth, a100.memory_bytes) == (312e12, 2.039e12, 80 * gib)
    assert (l4.peak_flops, l4.hbm_bandwidth, l4.memory_bytes) == (121e12, 300e9, 24 * gib)
    shapes = {
        name: (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim)
        for name, m in MODELS.items()
    }
    assert shapes == {
        "llama-3-8b": (32, 4096, 32, 8, 128),
        "qwen3-8b": (36, 4096, 32, 8, 128),
        "r1-distill-qwen-7b": (28, 3584, 28, 4, 128),
        "qwen3-32b": (64, 5120, 64, 8, 128),
    }
    params = {name: round(m.num_params / 1e7) / 100 for name, m in MODELS.items()}
    assert params == {
        "llama-3-8b": 8.03,
        "qwen3-8b": 8.19,
        "r1-distill-qwen-7b": 7.62,
        "qwen3-32b": 32.76,
    }
    sources = [h.source for h in HARDWARE.values()] + [m.source for m in MODELS.values()]
    assert all(len(source) > 40 for source in sources)


def test_unknown_preset_lists_the_known_names() -> None:
    with pytest.raises(ConfigError, match=r"'h200'.*a100-sxm-80g, h100-sxm, l4"):
        hardware_preset("h200")
    with pytest.raises(ConfigError, match=r"known: llama-3-8b, qwen3-32b"):
        model_preset("llama-2-7b")


TINY_MODEL = """
[model.tiny]
num_params = 10
num_layers = 1
hidden_size = 8
num_attention_heads = 2
num_kv_heads = 1
head_dim = 4
bytes_per_param = 2
source = "x"
"""
BAD_HARDWARE = """
[hardware.x]
peak_flops = 1e12
hbm_bandwidth = 1e11
memory_bytes = 1
mfu = 1.5
bandwidth_efficiency = 0.8
step_overhead_ns = 0
per_request_overhead_ns = 0
host_link_bandwidth = 1e9
source = ""
"""


def test_preset_file_errors_name_the_field() -> None:
    _, models, _ = load_presets(TINY_MODEL)
    assert models["tiny"].kv_bytes_per_token == 2 * 1 * 1 * 4 * 2
    with pytest.raises(ConfigError, match=r"model\.tiny: missing source"):
        load_presets(TINY_MODEL.replace('source = "x"\n', ""))
    with pytest.raises(ConfigError, match=r"model\.tiny\.num_layers must be int"):
        load_presets(TINY_MODEL.replace("num_layers = 1", 'num_layers = "one"'))
    with pytest.raises(ConfigError, match=r"hardware\.x\.mfu must be in \(0, 1\]; got 1.5"):
        load_presets(BAD_HARDWARE)
    with pytest.raises(ConfigError, match=r"unknown table\(s\) gpu"):
        load_presets("[gpu.x]\nname = 1\n")
    good_hardware = BAD_HARDWARE.replace("mfu = 1.5", "mfu = 0.5")
    with pytest.raises(ConfigError, match=r"no \[vllm_defaults\] for x"):
        load_presets(good_hardware)
    defaults = (
        "[vllm_defaults.x]\nmax_num_seqs = 8\nmax_num_batched_tokens = 64\n"
        'gpu_memory_utilization = 0.9\nsource = "s"\n'
    )
    hardware, _, vllm = load_presets(good_hardware + defaults)
    assert vllm["x"].max_num_seqs == 8 and "x" in hardware


def test_every_hardware_preset_has_vllms_defaults() -> None:
    from meridian.sim.presets import VLLM_DEFAULTS, vllm_defaults

    assert set(VLLM_DEFAULTS) == set(HARDWARE)
    h100 = vllm_defaults("h100-sxm")
    assert (h100.max_num_seqs, h100.max_num_batched_tokens) == (1024, 8192)
    assert h100.gpu_memory_utilization == 0.92
    with pytest.raises(ConfigError, match="unknown hardware preset"):
        vllm_defaults("tpu")


def test_spec_validation_is_actionable() -> None:
    with pytest.raises(ConfigError, match="bandwidth_efficiency must be in"):
        dataclasses.replace(HARDWARE["l4"], bandwidth_efficiency=0.0)
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelSpec("odd", 10, 1, 8, num_attention_heads=3, num_kv_heads=2, head_dim=4)
    assert isinstance(HARDWARE["l4"], HardwareSpec)


# --- fitted model --------------------------------------------------------------------------------

TRUE_MS = (2.0, 0.04, 0.03, 2.5e-6, 0.015)  # base, per prefill token, decode seq, KV token, seq


def synthetic_samples(
    coefficients_ms: tuple[float, ...], num_samples: int, seed: int
) -> list[tuple[BatchShape, float]]:
    """Batches of every kind, timed by a known linear function (milliseconds)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        num_decode = rng.randint(0, 256)
        num_prefill = rng.choice([0, rng.randint(1, 8192)])
        prefill_requests = rng.randint(1, min(num_prefill, 8)) if num_prefill else 0
        if num_decode + prefill_requests == 0:
            num_decode = 1
        kv = num_prefill + num_decode + rng.randint(0, 1_000_000)
        batch = BatchShape(num_prefill, num_decode, kv, num_decode + prefill_requests)
        features = (1, num_prefill, num_decode, kv, batch.num_seqs)
        samples.append((batch, sum(c * x for c, x in zip(coefficients_ms, features, strict=True))))
    return samples


def test_fit_recovers_known_coefficients() -> None:
    fitted = FittedStepTime.from_samples(synthetic_samples(TRUE_MS, 60, seed=1))
    expected_ns = tuple(c * 1e6 for c in TRUE_MS)
    assert fitted.coefficients_ns == pytest.approx(expected_ns, rel=1e-6)
    assert fitted.r_squared == pytest.approx(1.0, abs=1e-9)
    assert fitted.max_relative_error < 1e-9
    assert fitted.num_samples == 60
    batch = BatchShape(512, 32, 100_000, 33)
    assert fitted.step_time_ns(batch) == round(
        2e6 + 512 * 4e4 + 32 * 3e4 + 100_000 * 2.5 + 33 * 1.5e4
    )


def test_fit_with_noise_reports_its_error() -> None:
    rng = random.Random(7)
    noisy = [(b, t * rng.uniform(0.9, 1.1)) for b, t in synthetic_samples(TRUE_MS, 200, seed=2)]
    fitted = FittedStepTime.from_samples(noisy)
    assert 0.9 < fitted.r_squared < 1.0
    assert 0.0 < fitted.max_relative_error < 0.5
    assert fitted.ns_per_prefill_token == pytest.approx(4e4, rel=0.1)


def test_negative_coefficient_is_clamped_to_zero_and_refitted() -> None:
    # A truth where more KV makes a step faster: the fit must not follow it below zero.
    truth = (20.0, 0.04, 0.03, -5e-6, 0.015)
    fitted = FittedStepTime.from_samples(synthetic_samples(truth, 80, seed=3))
    assert fitted.ns_per_kv_token == 0.0
    assert all(c >= 0 for c in fitted.coefficients_ns)
    assert fitted.ns_per_prefill_token > 0 and fitted.r_squared < 1.0


def write_csv(path: Path, samples: list[tuple[BatchShape, float]]) -> Path:
    lines = [",".join(CSV_COLUMNS)]
    for b, t in samples:
        lines.append(
            f"{b.num_prefill_tokens},{b.num_decode_seqs},{b.num_kv_tokens_read},{b.num_seqs},{t!r}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_from_csv_fits_the_same_model(tmp_path: Path) -> None:
    samples = synthetic_samples(TRUE_MS, 30, seed=4)
    fitted = FittedStepTime.from_csv(write_csv(tmp_path / "h100.csv", samples))
    assert fitted.label == "fitted:h100.csv"
    assert fitted.coefficients_ns == pytest.approx(tuple(c * 1e6 for c in TRUE_MS), rel=1e-6)


def test_csv_missing_column_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("num_prefill_tokens,num_decode_seqs,num_seqs,step_time_ms\n0,1,1,5.0\n")
    with pytest.raises(
        CalibrationError, match=r"bad\.csv:1: missing column\(s\) num_kv_tokens_read"
    ):
        FittedStepTime.from_csv(path)


def test_csv_non_number_names_file_and_line(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "bad.csv", synthetic_samples(TRUE_MS, 6, seed=5))
    lines = path.read_text().splitlines()
    lines[3] = "0,4,abc,4,5.0"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match=r"bad\.csv:4: column num_kv_tokens_read: 'abc'"):
        FittedStepTime.from_csv(path)
    lines[3] = "0,4,4000,4,fast"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match=r"bad\.csv:4: column step_time_ms: 'fast'"):
        FittedStepTime.from_csv(path)
    lines[3] = "0,4,2,4,5.0"  # fewer KV tokens than decode rows
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match=r"bad\.csv:4: .*num_kv_tokens_read"):
        FittedStepTime.from_csv(path)


def test_csv_with_too_few_rows_is_rejected(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "short.csv", synthetic_samples(TRUE_MS, 4, seed=6))
    with pytest.raises(CalibrationError, match=r"short\.csv: 4 samples; at least 5"):
        FittedStepTime.from_csv(path)
    with pytest.raises(CalibrationError, match="empty file"):
        FittedStepTime.from_csv(_empty(tmp_path))
    with pytest.raises(CalibrationError, match="step-time CSV not found"):
        FittedStepTime.from_csv(tmp_path / "absent.csv")


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.csv"
    path.write_text("")
    return path


def test_samples_that_never_exercise_a_dimension_are_rejected() -> None:
    decode_only = [(BatchShape.decode_only(n, 1000), 5.0 + n * 0.1) for n in range(1, 10)]
    with pytest.raises(CalibrationError, match="no sample exercises ns_per_prefill_token"):
        FittedStepTime.from_samples(decode_only)
