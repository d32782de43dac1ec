"""Every Config field through its flag and its TOKENMILL_* variable, typed by its annotation; precedence and errors."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import main
from tokenmill.config import (
    RATE_LIMITS,
    Config,
    ConfigError,
    Rate,
    add_config_arguments,
    add_settings_arguments,
    config_from_args,
    parse_rate,
    settings_from_args,
)

FIELDS = dataclasses.fields(Config)
HINTS = typing.get_type_hints(Config)
# Weight-only quantisation needs bfloat16 activations; pinned so the quantization case holds whatever dtype's default is.
TWO_MODELS = ("a.gguf", "b.gguf")  # what a second name or KV weight needs
COMPANIONS: dict[str, dict[str, Any]] = {
    "quantization": {"dtype": "bfloat16"},
    "served_model_name": {"model": TWO_MODELS},
    "kv_cache_weights": {"model": TWO_MODELS},
    "min_replicas": {"max_replicas": 9},  # autoscaling settings need its upper bound
    "target_ongoing_requests": {"max_replicas": 9},
    "simulate_engine": {"replicas": 2},  # it stands in for engine replicas
    "simulated_service_times": {"replicas": 2, "simulate_engine": True},
}
VALUES: dict[str, Any] = {  # str fields whose text Config checks
    **{name: "90/min" for name in RATE_LIMITS},
    "speculative_config": '{"method": "ngram", "prompt_lookup_max": 3}',
    "lora": ("tuned=/adapters/tuned", "terse=/adapters/terse.gguf"),
    "simulated_service_times": "0.0464,0.0035,0.0059",
}


@pytest.fixture(autouse=True)
def _no_tokenmill_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("TOKENMILL_"):
            monkeypatch.delenv(name)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return "TOKENMILL_" + name.upper()


def parse(argv: list[str]) -> Config:
    return config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_config_arguments(parser)
    return parser


def scalar_type(annotation: Any) -> Any:
    """`int | None` -> int, `tuple[str, ...]` -> tuple (the elements are checked separately)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return scalar_type(inner)
    return typing.get_origin(annotation) or annotation


def other_value(f: dataclasses.Field[Any]) -> Any:
    """A valid value of the field's type that differs from its default."""
    kind, default = scalar_type(HINTS[f.name]), f.default
    assert default is not dataclasses.MISSING, f"{f.name} needs a default to be left out"
    if f.name in VALUES:
        return VALUES[f.name]
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != default)
    if kind is bool:
        return not default
    if kind is int:
        return 7 if default is None else default + 1
    if kind is float:
        return 2.5 if default != 2.5 else 3.5
    if kind is str:
        return f"other-{f.name}"
    if kind is tuple:
        return (1.5, 2.5) if typing.get_args(HINTS[f.name])[0] is float else ("key-a", "key-b")
    raise AssertionError(f"no test value for {f.name}: {HINTS[f.name]}")


def as_flags(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):  # a switch: --x / --no-x
        return [flag(name) if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, tuple):
        return [arg for item in value for arg in (flag(name), str(item))]
    return [flag(name), str(value)]


def as_env(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def assert_typed(f: dataclasses.Field[Any], got: Any, want: Any) -> None:
    assert got == want
    # type(), not isinstance(): a bool would pass for an int
    assert type(got) is scalar_type(HINTS[f.name])
    if isinstance(want, tuple):
        assert all(type(item) is typing.get_args(HINTS[f.name])[0] for item in got)


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_field_parses_from_its_flag_to_its_annotated_type(f: dataclasses.Field[Any]) -> None:
    value = other_value(f)
    companions = [arg for name, v in COMPANIONS.get(f.name, {}).items() for arg in as_flags(name, v)]
    config = parse(as_flags(f.name, value) + companions)
    assert_typed(f, getattr(config, f.name), value)


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_field_parses_from_its_env_var_to_its_annotated_type(
    f: dataclasses.Field[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    value = other_value(f)
    monkeypatch.setenv(env_var(f.name), as_env(value))
    for name, v in COMPANIONS.get(f.name, {}).items():
        monkeypatch.setenv(env_var(name), as_env(v))
    assert_typed(f, getattr(parse([]), f.name), value)


def test_flag_beats_env_and_unset_gives_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]) == Config()
    monkeypatch.setenv("TOKENMILL_PORT", "9001")
    monkeypatch.setenv("TOKENMILL_THREADS", "3")
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    config = parse(["--port", "9002", "--api-key", "from-flag"])
    assert (config.port, config.threads, config.api_key) == (9002, 3, ("from-flag",))
    assert config.max_num_seqs == Config().max_num_seqs


def test_an_empty_env_var_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_THREADS", "")
    monkeypatch.setenv("TOKENMILL_HOST", "")
    assert parse([]) == Config()


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("TOKENMILL_PORT", "abc", "TOKENMILL_PORT: invalid int value: 'abc'"),
        ("TOKENMILL_MAX_MODEL_LEN", "4k", "TOKENMILL_MAX_MODEL_LEN: invalid int value: '4k'"),
        ("TOKENMILL_REQUEST_TIMEOUT_S", "soon", "TOKENMILL_REQUEST_TIMEOUT_S: invalid float value: 'soon'"),
        ("TOKENMILL_DTYPE", "float16", "TOKENMILL_DTYPE: invalid choice: 'float16'"),
        ("TOKENMILL_QUANTIZATION", "int3", "TOKENMILL_QUANTIZATION: invalid choice: 'int3'"),
    ],
)
def test_a_malformed_env_var_is_a_clear_error_naming_it(
    var: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as raised:
        parse([])
    assert str(raised.value).startswith(message)


def test_the_cli_reports_a_bad_env_var_as_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENMILL_PORT", "abc")
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    assert exited.value.code == 2
    assert "tokenmill serve: error: TOKENMILL_PORT: invalid int value: 'abc'" in capsys.readouterr().err


def test_the_cli_reports_settings_config_refuses_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--dtype", "float32", "--quantization", "int8"])
    assert exited.value.code == 2
    assert "weight-only quantisation runs with bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--port", "abc"], ["--threads", "two"], ["--request-timeout-s", "soon"], ["--dtype", "float16"]],
)
def test_a_malformed_flag_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    assert f"argument {argv[0]}: invalid" in capsys.readouterr().err


def test_config_still_refuses_quantisation_without_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        parse(["--dtype", "float32", "--quantization", "int4"])
    monkeypatch.setenv("TOKENMILL_DTYPE", "float32")
    monkeypatch.setenv("TOKENMILL_QUANTIZATION", "int8")
    with pytest.raises(ConfigError, match="bfloat16"):
        parse([])
    assert parse(["--quantization", "none"]).weight_quantization == "none"


def test_help_lists_every_setting_with_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    # argparse wraps help text, even inside a hyphenated word, so compare with all whitespace removed
    text = "".join(capsys.readouterr().out.split())
    for f in FIELDS:
        assert flag(f.name) in text
        assert "".join(f.metadata["help"].split()) in text
    assert "TOKENMILL_" in text


@dataclasses.dataclass(frozen=True)
class Switches:
    warmup: bool = dataclasses.field(default=True, metadata={"help": "run one step before serving"})
    trace: bool = dataclasses.field(default=False, metadata={"help": "log every step"})
    workers: int | None = dataclasses.field(default=None, metadata={"help": "worker count"})


def parse_switches(argv: list[str]) -> Switches:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, Switches)
    return settings_from_args(Switches, parser.parse_args(argv))


def test_a_bool_field_is_a_flag_and_no_flag_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_switches([]) == Switches()
    assert parse_switches(["--no-warmup", "--trace"]) == Switches(warmup=False, trace=True)
    monkeypatch.setenv("TOKENMILL_WARMUP", "0")
    monkeypatch.setenv("TOKENMILL_TRACE", "yes")
    assert parse_switches([]) == Switches(warmup=False, trace=True)
    assert parse_switches(["--warmup", "--no-trace"]) == Switches(warmup=True, trace=False)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("False", False), ("no", False)]
    + [("off", False)],
)
def test_bool_env_words(text: str, value: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRACE", text)
    assert parse_switches([]).trace is value


def test_a_bool_env_var_outside_the_words_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_TRACE", "maybe")
    with pytest.raises(ConfigError, match="TOKENMILL_TRACE: invalid bool value: 'maybe'"):
        parse_switches([])


def test_an_unsupported_annotation_is_refused_when_the_flags_are_built() -> None:
    @dataclasses.dataclass(frozen=True)
    class Odd:
        ratio: complex = 1j

    with pytest.raises(TypeError, match="complex"):
        add_settings_arguments(argparse.ArgumentParser(), Odd)


# --- several models -----------------------------------------------------------------------------------------------
def test_one_config_per_model_with_its_name_and_share_of_the_kv_cache(tmp_path: Path) -> None:
    config = parse(["--model", "a.gguf", "--model", "coder=/models/b", "--model-name", "first", "--kv-cache-mb", "600"])
    one, two = config.per_model()
    assert (one.model, one.served_model_name, one.kv_cache_mb) == (("a.gguf",), ("first",), 300)
    assert (two.model, two.served_model_name, two.kv_cache_mb) == (("/models/b",), ("coder",), 300)
    weighted = dataclasses.replace(config, kv_cache_weights=(1.0, 2.0)).per_model()
    assert [c.kv_cache_mb for c in weighted] == [200, 400]
    assert all(c.kv_cache_weights == () and len(c.model) == 1 for c in weighted)
    # a path that exists is a path, whatever it holds
    odd = tmp_path / "x=y.gguf"
    odd.write_bytes(b"")
    assert Config(model=str(odd)).per_model()[0].model_path == str(odd)
    assert Config(model="x=y.gguf").per_model()[0].model == ("y.gguf",)


def test_the_default_model_is_one_config_with_no_path() -> None:
    [only] = Config().per_model()
    assert only.model == () and only.model_path is None and only.kv_cache_mb == Config().kv_cache_mb


@pytest.mark.parametrize(
    "changes",
    [
        {"model": ("a.gguf",), "served_model_name": ("x", "y")},
        {"model": ("a.gguf", "b.gguf"), "kv_cache_weights": (1.0,)},
        {"model": ("a.gguf", "b.gguf"), "kv_cache_weights": (1.0, 0.0)},
    ],
)
def test_names_and_weights_must_match_the_models(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Config(**changes)


def test_a_config_of_several_models_has_no_single_path() -> None:
    with pytest.raises(ConfigError, match="per_model"):
        _ = Config(model=("a.gguf", "b.gguf")).model_path


# --- rate limits --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "rate", "period_s"),
    [("600/min", Rate(600, "min"), 60.0), ("5/s", Rate(5, "s"), 1.0), (" 1/h ", Rate(1, "h"), 3600.0)],
)
def test_a_rate_is_n_per_second_minute_or_hour(text: str, rate: Rate, period_s: float) -> None:
    assert parse_rate(text) == rate and rate.period_s == period_s


@pytest.mark.parametrize(
    "text", ["600", "600/m", "600/minute", "600/MIN", "0/min", "-5/s", "1.5/s", "1e3/h", "/min", "²/s", "5/s/s", ""]
)
@pytest.mark.parametrize("name", RATE_LIMITS)
def test_config_refuses_any_other_rate_naming_the_setting(text: str, name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be N/s, N/min or N/h"):
        Config(**{name: text})


def test_the_cli_reports_a_bad_rate_limit_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--rate-limit-tokens", "1000/m"])
    assert exited.value.code == 2
    assert "rate_limit_tokens must be N/s, N/min or N/h" in capsys.readouterr().err


def test_lora_takes_vllms_several_adapters_after_one_flag() -> None:
    config = parse(["--lora-modules", "a=/x", "b=/y.gguf", "--lora", "c=/z"])
    assert config.lora_modules == [("a", "/x"), ("b", "/y.gguf"), ("c", "/z")]
