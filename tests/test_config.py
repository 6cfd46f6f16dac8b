"""Configuration: defaults, ranges, cross-field rules, errors, loading order, the example."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from meridian.config import (
    BUNDLED_MODELS,
    EntropyConfig,
    KvMemoryConfig,
    MeridianConfig,
    ModelDefinition,
    load_config,
    parse_config_text,
)
from meridian.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "meridian.toml.example"


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, source="m.toml")
    return str(info.value)


def test_defaults_match_the_design() -> None:
    c = MeridianConfig()
    assert c.scheduler.think_tpot_budget_ms == 80.0
    assert c.scheduler.output_tpot_budget_ms == 20.0
    assert c.scheduler.think_batch_multiplier == 2.5
    assert (c.scheduler.max_think_tokens, c.scheduler.min_think_tokens) == (32768, 512)
    assert c.entropy.enabled and c.entropy.ema_alpha == 0.05
    assert c.entropy.rpdi_threshold == 3.0
    assert c.entropy.eat_ema_variance_threshold == 0.001
    assert c.entropy.transition_entropy_threshold == 2.5
    assert c.entropy.eat_probe_interval_tokens == 32
    assert c.entropy.effective_eat_min_distance == 40  # 2 / ema_alpha
    assert c.kv_memory.block_size_bytes == 16384 and c.kv_memory.block_size_tokens == 16
    assert c.kv_memory.capacity_bytes == "auto"
    assert not c.telemetry.otlp_enabled


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[entropy]\nema_alpha = 1.5", "entropy.ema_alpha must be in (0, 1]; got 1.5"),
        ("[entropy]\nema_alpha = 0.0", "entropy.ema_alpha must be in (0, 1]; got 0.0"),
        ("[entropy]\nrpdi_threshold = 1.0", "entropy.rpdi_threshold must be in (1, inf); got 1.0"),
        ("[scheduler]\nthink_batch_multiplier = 0.5", "scheduler.think_batch_multiplier"),
        ("[scheduler]\noutput_tpot_budget_ms = -1", "scheduler.output_tpot_budget_ms"),
        (
            "[scheduler]\noutput_tpot_budget_ms = inf",
            "scheduler.output_tpot_budget_ms must be in [0.001, 3600000]; got inf",
        ),
        ("[scheduler]\nthink_batch_multiplier = inf", "scheduler.think_batch_multiplier"),
        ("[entropy]\neat_ema_variance_threshold = inf", "entropy.eat_ema_variance_threshold"),
        ("[entropy]\ntransition_entropy_threshold = inf", "entropy.transition_entropy_threshold"),
        ("[entropy]\nrpdi_threshold = 1e400", "entropy.rpdi_threshold"),
        ("[scheduler]\nanswer_pace_ms = nan", "scheduler.answer_pace_ms"),
        (
            "[scheduler]\nadmission_wait_weight = -0.5",
            "scheduler.admission_wait_weight must be in [0, 1000000]; got -0.5",
        ),
        ("[scheduler]\nadmission_wait_weight = inf", "scheduler.admission_wait_weight must be in"),
        ("[scheduler]\nthink_tpot_budget_ms = inf", "scheduler.think_tpot_budget_ms must be in"),
        (
            "[entropy]\nema_alpha = 5e-324",
            "entropy.ema_alpha must be at least 4.66e-10 without entropy.eat_min_distance",
        ),
        (
            "[model.x]\nthink_start = '<t>'\nthink_end = '</t>'\nreasoning_parser = 'qwen3'\n"
            "think_start_token_ids = [-1]",
            "model.x.think_start_token_ids must hold token ids in [0, 2147483647]; -1 is not",
        ),
        (
            "[model.qwen3]\nthink_end_token_ids = [4611686018427387904]",
            "model.qwen3.think_end_token_ids must hold token ids in [0, 2147483647]",
        ),
        (
            "[model.qwen3]\nthink_end_token_ids = []",
            "model.qwen3.think_end_token_ids must list at least one token id",
        ),
        ("[model.qwen3]\nthink_end = '<think>'", "model.qwen3.think_end must differ from"),
        ("[model.qwen3]\nthink_end_token_ids = [151667]", "think_end_token_ids must differ"),
        ("[model.qwen3]\nthink_start = ''", "model.qwen3.think_start must not be empty"),
        ("[scheduler]\nthink_starvation_steps = 0", "scheduler.think_starvation_steps"),
        ("[scheduler]\npreempt_max_fraction = 1.5", "scheduler.preempt_max_fraction"),
        (
            "[kv_memory]\nthink_phase_memory_fraction = 0.4",
            "kv_memory.think_phase_memory_fraction was removed; delete it from the file",
        ),
        (
            "[kv_memory]\naggressive_think_eviction = true",
            "kv_memory.aggressive_think_eviction was removed; delete it",
        ),
        ("[kv_memory]\nblock_size_bytes = 0", "kv_memory.block_size_bytes"),
        ("[kv_memory]\ncapacity_bytes = 'lots'", 'kv_memory.capacity_bytes must be "auto" or'),
        # Values that allocate, bounded by what a real node holds (issue 41).
        (
            "[kv_memory]\ncapacity_bytes = 1208925819614629174706176",
            'kv_memory.capacity_bytes must be "auto" or a number of bytes in [1, 4398046511104]',
        ),
        ("[kv_memory]\nblock_size_bytes = 4398046511104", "kv_memory.block_size_bytes must be in"),
        ("[entropy]\nrpdi_window_tokens = 65537", "entropy.rpdi_window_tokens must be in [1, 6"),
        (
            "[scheduler]\nforce_transition_phrase = '" + "x" * 3000 + "'",
            "scheduler.force_transition_phrase: string should have at most 256 characters",
        ),
        ("[model.x]\nthink_start = 'a'\nthink_end = '" + "y" * 300 + "'", "model.x.think_end"),
        ("[entropy]\nenabled = 1", "entropy.enabled"),
        ("[telemetry]\notlp_endpoint = 4318", "telemetry.otlp_endpoint"),
        # Accepted without a word before (issue 31): values nothing downstream can use.
        (
            "[scheduler]\nmax_think_tokens = 99999999999999999999999999999999",
            "scheduler.max_think_tokens must be in [1, 2147483647]; got 9999",
        ),
        (
            "[telemetry]\notlp_enabled = true\notlp_endpoint = ''",
            "telemetry.otlp_endpoint must be an http:// or https:// URL with a host when "
            "telemetry.otlp_enabled is true; got ''",
        ),
        (
            "[telemetry]\notlp_enabled = true\notlp_endpoint = 'localhost:4318'",
            "telemetry.otlp_endpoint must be an http:// or https:// URL",
        ),
        (
            "[telemetry]\notlp_enabled = true\notlp_endpoint = 'http://h:99999'",
            "telemetry.otlp_endpoint must be an http:// or https:// URL",
        ),
        (
            "[kv_memory]\nblock_size_tokens = 4294967295",
            "kv_memory.block_size_tokens must be in [1, 65536]; got 4294967295",
        ),
        (
            "[kv_memory]\ncapacity_bytes = 1000",
            "kv_memory.capacity_bytes must hold at least 2 blocks of kv_memory.block_size_bytes "
            "(32768 bytes); got 1000",
        ),
        (
            "[scheduler]\nforce_transition_phrase = '</think>'",
            "scheduler.force_transition_phrase must not contain '</think>', a think marker of "
            "deepseek_r1, qwen3, qwq, r1_distill_qwen",
        ),
        (
            "[scheduler]\nforce_transition_phrase = 'Done. <think>'",
            "scheduler.force_transition_phrase must not contain '<think>'",
        ),
        (
            "[scheduler]\nforce_transition_phrase = 'ok </reason>'\n[model.mine]\n"
            "think_start = '<reason>'\nthink_end = '</reason>'\nreasoning_parser = 'x'",
            "must not contain '</reason>', a think marker of mine",
        ),
    ],
)
def test_out_of_range_values_name_the_dotted_path(text: str, expected: str) -> None:
    message = error_of(text)
    assert message.startswith("m.toml: ")
    assert expected in message


def test_unknown_fields_are_rejected_with_their_path() -> None:
    assert "entropy.ema_alhpa: unknown field" in error_of("[entropy]\nema_alhpa = 0.1")
    assert "bogus: unknown field" in error_of("[bogus]\nx = 1")


@pytest.mark.parametrize(
    "text", ["[disagg]\nenabled = true\nfabric = 'nixl'", "[disagg]\n", "[disagg.pool]\nx = 1"]
)
def test_a_disagg_section_names_its_replacement(text: str) -> None:
    # The KV pool and offload manager are retired (issue 14): an old file's [disagg] table gets
    # one line saying what replaced it, never "unknown field" and never one line per key.
    message = error_of(text)
    assert "\n" not in message
    assert message.startswith("m.toml: disagg was removed; delete it from the file: ")
    assert "vLLM's OffloadingConnector" in message
    assert "`meridian serve --kv-offload-gib N`" in message


def test_limits_are_accepted_at_the_edge() -> None:
    edge = parse_config_text(
        "[scheduler]\nmax_think_tokens = 2147483647\nforce_transition_phrase = 'So, done.'\n"
        "[kv_memory]\nblock_size_tokens = 65536\ncapacity_bytes = 32768\n"
        "[telemetry]\notlp_enabled = true\notlp_endpoint = 'https://collector:4318/'\n"
    )
    assert edge.scheduler.max_think_tokens == 2**31 - 1
    assert edge.kv_memory.capacity_bytes == 2 * edge.kv_memory.block_size_bytes
    # An endpoint is checked only when it is used.
    assert parse_config_text("[telemetry]\notlp_endpoint = ''").telemetry.otlp_endpoint == ""


def test_cross_field_rules() -> None:
    msg = error_of("[scheduler]\nmax_think_tokens = 100\nmin_think_tokens = 200")
    assert "scheduler.max_think_tokens must be greater than scheduler.min_think_tokens" in msg
    assert "got 100" in msg


def test_several_errors_are_all_reported() -> None:
    msg = error_of("[entropy]\nema_alpha = 2.0\nrpdi_threshold = 0.5")
    assert "entropy.ema_alpha" in msg and "entropy.rpdi_threshold" in msg


def test_malformed_toml_gives_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "meridian.toml"
    path.write_text("[scheduler]\nthink_tpot_budget_ms = = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2:")) as info:
        load_config(path)
    assert "malformed TOML" in str(info.value)


def test_deep_nesting_is_a_one_line_error() -> None:
    deep = "[scheduler]\nx = " + "[" * 5000 + "]" * 5000 + "\n"
    assert error_of(deep) == "m.toml: malformed TOML: arrays or inline tables nested too deeply"


def test_a_tiny_ema_alpha_works_with_an_explicit_distance() -> None:
    c = parse_config_text("[entropy]\nema_alpha = 5e-324\neat_min_distance = 10\n")
    assert c.entropy.effective_eat_min_distance == 10


def test_small_file_overrides_only_what_it_names() -> None:
    c = parse_config_text("[entropy]\nema_alpha = 0.1\n")
    assert c.entropy.ema_alpha == 0.1
    assert c.entropy.effective_eat_min_distance == 20
    assert c.entropy.rpdi_threshold == 3.0
    assert c.scheduler == MeridianConfig().scheduler


def test_model_table_overrides_bundled_fields_and_adds_families() -> None:
    c = parse_config_text("[model.qwen3]\nthink_starts_in_prompt = true\n")
    q = c.model_definition("qwen3")
    assert q.think_starts_in_prompt and q.think_end == "</think>"
    assert q.think_end_token_ids == [151668]
    c = parse_config_text(
        '[model.mine]\nthink_start = "<reason>"\nthink_end = "</reason>"\n'
        'reasoning_parser = "deepseek_r1"\n'
    )
    assert c.model_definition("mine").think_start == "<reason>"
    assert set(BUNDLED_MODELS) <= set(c.all_models())
    with pytest.raises(ConfigError, match=r"unknown model family 'nope'.*\[model.nope\]"):
        c.model_definition("nope")
    assert "model.half.reasoning_parser: required" in error_of(
        '[model.half]\nthink_start = "a"\nthink_end = "b"\n'
    )


def test_loading_order(tmp_path: Path) -> None:
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    (home / ".config" / "meridian").mkdir(parents=True)
    cwd.mkdir()
    assert load_config(cwd=cwd, home=home).source is None
    user = home / ".config" / "meridian" / "meridian.toml"
    user.write_text("[entropy]\nema_alpha = 0.2\n")
    loaded = load_config(cwd=cwd, home=home)
    assert loaded.source == user and loaded.config.entropy.ema_alpha == 0.2
    local = cwd / "meridian.toml"
    local.write_text("[entropy]\nema_alpha = 0.3\n")
    loaded = load_config(cwd=cwd, home=home)
    assert loaded.source == local and loaded.config.entropy.ema_alpha == 0.3
    explicit = tmp_path / "x.toml"
    explicit.write_text("[entropy]\nema_alpha = 0.4\n")
    assert load_config(explicit, cwd=cwd, home=home).config.entropy.ema_alpha == 0.4
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml", cwd=cwd, home=home)


def test_auto_capacity_needs_a_device() -> None:
    kv = KvMemoryConfig()
    assert kv.resolve_capacity_bytes(100 * 2**30) == int(100 * 2**30 * 0.92)
    with pytest.raises(ConfigError, match=r"kv_memory.capacity_bytes is \"auto\""):
        kv.resolve_capacity_bytes(None)
    assert KvMemoryConfig(capacity_bytes=1 << 20).resolve_capacity_bytes(None) == 1 << 20


def test_eat_min_distance_override() -> None:
    assert EntropyConfig(eat_min_distance=7).effective_eat_min_distance == 7


def _fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


def test_example_parses_and_documents_every_field() -> None:
    text = EXAMPLE.read_text()
    config = parse_config_text(text, source=str(EXAMPLE))
    # The example is the defaults plus a [model.qwen3] table identical to the bundled one.
    assert config == MeridianConfig(model={"qwen3": BUNDLED_MODELS["qwen3"]})
    # Every field of every section appears as `name =` (active or commented) in the example.
    raw = tomllib.loads(text)
    missing: list[str] = []
    for section, model in MeridianConfig.model_fields.items():
        if section == "model":
            continue
        annotation = model.annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        for name in _fields(annotation):
            if not re.search(rf"^#?\s*{name}\s*=", text, re.MULTILINE):
                missing.append(f"{section}.{name}")
        assert section in raw, f"[{section}] missing from the example"
    for name in _fields(ModelDefinition):
        if not re.search(rf"^#?\s*{name}\s*=", text, re.MULTILINE):
            missing.append(f"model.<name>.{name}")
    assert not missing, f"fields missing from meridian.toml.example: {missing}"


def test_example_values_are_the_defaults() -> None:
    """The example documents the defaults; a drift between code and docs fails here."""
    raw = tomllib.loads(EXAMPLE.read_text())
    defaults = MeridianConfig().model_dump()
    for section, values in raw.items():
        if section == "model":
            continue
        for key, value in values.items():
            assert defaults[section][key] == value, f"{section}.{key}"
