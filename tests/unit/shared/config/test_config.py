"""shared/config/: daemon configs from YAML plus overrides, and job specs. Unknown keys,
wrong types and out-of-range values are ``ConfigError``s whose message names the file and the
field (docs/architecture.md, "Invariants"); the CLI's flags override the file (``load_config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import (
    ConfigError,
    CoordinatorConfig,
    WorkerConfig,
    job_spec_from_json,
    load_config,
    parse_job_spec,
)

# (YAML text, the message after "FILE: "): the field path, then pydantic's or our words.
BAD_COORDINATOR_YAML = [
    ("slotz: 4\n", "slotz: Extra inputs are not permitted"),
    ("log: {level: info, colour: red}\n", "log.colour: Extra inputs are not permitted"),
    (
        "slots: four\n",
        "slots: Input should be a valid integer, unable to parse string as an integer",
    ),
    (
        "heartbeat_interval_s: fast\n",
        "heartbeat_interval_s: Input should be a valid number, unable to parse string as a number",
    ),
    ("allowed_models: mymodels\n", "allowed_models: Input should be a valid dictionary"),
    (
        "allowed_imports: [mymodels]\n",
        "allowed_imports: removed; list model entry points instead, as allowed_models: "
        "{NAME: 'package.module:function'}, and name them in a job as "
        "model: {entry: NAME, args: {...}}",
    ),
    ("log: {level: loud}\n", "log.level: Input should be 'debug', 'info', 'warning' or 'error'"),
    ("slots: 1000\n", "slots: must be a power of two, got 1000"),
    ("slots: 131072\n", "slots: Input should be less than or equal to 65536"),
    ("metrics_port: 70000\n", "metrics_port: Input should be less than or equal to 65535"),
    ("heartbeat_interval_s: 0\n", "heartbeat_interval_s: Input should be greater than 0"),
    (
        "job_retention: {max_jobs: 0}\n",
        "job_retention.max_jobs: Input should be greater than or equal to 1",
    ),
    ("listen: nohost\n", "listen: expected HOST:PORT with a port in 0..65535, got 'nohost'"),
    (
        "heartbeat_interval_s: 3\nheartbeat_timeout_s: 2\n",
        "heartbeat_timeout_s must be larger than heartbeat_interval_s (2.0 <= 3.0)",
    ),
]

BAD_WORKER_YAML = [
    ("fsync: sometimes\n", "fsync: Input should be 'always', 'interval' or 'never'"),
    (
        "snapshot_log_bytes: 10\n",
        "snapshot_log_bytes: Input should be greater than or equal to 4096",
    ),
    ("coordinator: localhost\n", "coordinator: expected HOST:PORT with a port in 0..65535, got"),
    ("name: ''\n", "name: String should have at least 1 character"),
    ("device: tpu\n", "device: Input should be 'auto', 'cpu' or 'cuda'"),
    (
        "advertise_address: proxy-host\n",
        "advertise_address: expected HOST:PORT with a port in 0..65535, got 'proxy-host'",
    ),
    (
        "advertise_address: 127.0.0.1:0\n",
        "advertise_address: port 0 cannot be dialed; give the port others connect to",
    ),
    (
        "advertise_host: w0\nadvertise_address: 127.0.0.1:7000\n",
        "advertise_address: advertise_host and advertise_address are exclusive",
    ),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), BAD_COORDINATOR_YAML)
def test_bad_coordinator_yaml_names_the_file_and_field(tmp_path, text, message) -> None:
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as info:
        load_config(CoordinatorConfig, path)

    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize(("text", "message"), BAD_WORKER_YAML)
def test_bad_worker_yaml_names_the_file_and_field(tmp_path, text, message) -> None:
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, path)

    assert str(info.value).startswith(f"{path}: {message}")


@pytest.mark.xfail(
    strict=True,
    reason="pydantic's lax mode reads a YAML/JSON boolean as the integer 1 or 0",
)
@pytest.mark.parametrize(
    "load",
    [
        lambda path: load_config(CoordinatorConfig, write(path, "slots: true\n")),
        lambda path: parse_job_spec({"kind": "memory", "memories": True}),
    ],
    ids=["config-slots", "spec-memories"],
)
def test_a_boolean_is_not_an_integer(tmp_path, load) -> None:
    with pytest.raises(ConfigError):
        load(tmp_path)


def test_yaml_values_are_loaded_and_typed(tmp_path) -> None:
    path = write(tmp_path, "slots: 64\nheartbeat_interval_s: 1\nlog: {level: debug}\n")

    cfg = load_config(CoordinatorConfig, path)

    assert (cfg.slots, cfg.heartbeat_interval_s, cfg.log.level) == (64, 1.0, "debug")
    assert isinstance(cfg.heartbeat_interval_s, float)
    assert cfg.listen == CoordinatorConfig().listen  # absent keys keep their defaults


def test_empty_or_absent_file_gives_the_defaults(tmp_path) -> None:
    assert load_config(WorkerConfig, write(tmp_path, "")) == WorkerConfig()
    assert load_config(WorkerConfig, None) == WorkerConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slots: [\n", "invalid YAML"),
        ("- slots\n- 64\n", "expected a mapping of settings, got list"),
        ("just words\n", "expected a mapping of settings, got str"),
    ],
)
def test_a_file_that_is_not_a_mapping_of_settings_is_refused(tmp_path, text, message) -> None:
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as info:
        load_config(CoordinatorConfig, path)

    assert str(info.value).startswith(f"{path}: {message}")


def test_missing_file_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(CoordinatorConfig, tmp_path / "absent.yaml")


def test_overrides_win_over_the_file_and_none_leaves_it(tmp_path) -> None:
    # Arrange: what the CLI passes: its flags, None for flags not given.
    path = write(tmp_path, "slots: 64\nlisten: 127.0.0.1:7000\nmetrics_port: 9200\n")

    # Act
    cfg = load_config(CoordinatorConfig, path, slots=128, listen=None, metrics_port=0)

    # Assert
    assert (cfg.slots, cfg.listen, cfg.metrics_port) == (128, "127.0.0.1:7000", 0)


def test_a_bad_override_is_named_with_the_file(tmp_path) -> None:
    path = write(tmp_path, "slots: 64\n")

    with pytest.raises(ConfigError) as info:
        load_config(CoordinatorConfig, path, slots=100)

    assert str(info.value) == f"{path}: slots: must be a power of two, got 100"


def test_overrides_without_a_file_are_validated() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, None, fsync="sometimes")

    assert str(info.value) == "fsync: Input should be 'always', 'interval' or 'never'"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "train", "stepz": 1}, "stepz: Extra inputs are not permitted"),
        ({"kind": "train", "steps": 0}, "steps: Input should be greater than or equal to 1"),
        (
            {"kind": "train", "batch_size": "big"},
            "batch_size: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            {"kind": "train", "optimizer": {"name": "adam", "lr": -1}},
            "optimizer.lr: Input should be greater than 0",
        ),
        ({"kind": "train", "model": {"hidden": "x"}}, "model.hidden: Input should be a valid list"),
        (
            {"kind": "memory", "access": {"distribution": "zipf", "alpha": -1}},
            "access.alpha: Input should be greater than 0",
        ),
        ({"steps": 1}, "kind: expected 'train' or 'memory', got None"),
        ([1], "job spec: expected a mapping, got list"),
    ],
)
def test_bad_job_spec_names_the_field(spec, message) -> None:
    with pytest.raises(ConfigError) as info:
        parse_job_spec(spec)

    assert str(info.value) == message


def test_job_spec_json_that_does_not_parse_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^spec_json: not valid JSON \("):
        job_spec_from_json("{")


def test_advertise_address_is_kept_verbatim_and_by_flag() -> None:
    cfg = load_config(WorkerConfig, None, advertise_address="127.0.0.1:7000")
    assert cfg.advertise_address == "127.0.0.1:7000" and cfg.advertise_host is None
    assert load_config(WorkerConfig, None).advertise_address is None


def test_advertise_host_and_address_together_name_both_fields() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(WorkerConfig, None, advertise_host="w0", advertise_address="proxy:7000")

    assert str(info.value).startswith(
        "advertise_address: advertise_host and advertise_address are exclusive"
    )
