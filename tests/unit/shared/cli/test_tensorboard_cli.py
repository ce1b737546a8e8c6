"""``neuroshard tensorboard``: its flags, the data dir it serves, and the exposure rule.

Nothing listens: TensorBoard's server (``tensorboard.serve``) is replaced by a recorder.
The live server is started in ``tests/integration/test_tensorboard.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shared.cli import tensorboard
from shared.cli.common import CliError
from shared.cli.main import build_parser, main
from shared.config import ConfigError
from shared.security.exposure import ExposureRefused


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, str, int]]:
    """The (log dir, host, port) each ``serve`` call would have served."""
    calls: list[tuple[Path, str, int]] = []
    monkeypatch.setattr(tensorboard, "configure_logging", lambda: None)
    monkeypatch.setattr(tensorboard, "serve", lambda *a: calls.append(a))
    return calls


def _run(*argv: str) -> int:
    args = build_parser().parse_args(["tensorboard", *argv])
    return tensorboard.cmd_tensorboard(args)


def test_defaults_serve_the_data_dirs_tensorboard_dir_on_loopback_6006(
    served: list[tuple[Path, str, int]], tmp_path: Path
) -> None:
    # Act
    code = _run("--data-dir", str(tmp_path))

    # Assert: loopback, TensorBoard's port, the directory created when no job wrote one yet
    assert code == 0
    assert served == [(tmp_path / "tensorboard", "127.0.0.1", 6006)]
    assert (tmp_path / "tensorboard").is_dir()


def test_the_data_dir_comes_from_the_config_unless_given(
    served: list[tuple[Path, str, int]], tmp_path: Path
) -> None:
    # Arrange
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = tmp_path / "coordinator.yaml"
    config.write_text(f"data_dir: {tmp_path / 'a'}\n")

    # Act
    _run("--config", str(config), "--port", "0")
    _run("--config", str(config), "--data-dir", str(tmp_path / "b"), "--host", "localhost")

    # Assert
    assert served == [
        (tmp_path / "a" / "tensorboard", "127.0.0.1", 0),
        (tmp_path / "b" / "tensorboard", "localhost", 6006),
    ]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.2", "example.com"])
def test_an_open_host_is_refused_without_insecure(
    served: list[tuple[Path, str, int]], tmp_path: Path, host: str
) -> None:
    # Act
    with pytest.raises(ExposureRefused) as refused:
        _run("--data-dir", str(tmp_path), "--host", host)

    # Assert: the daemons' message, nothing served
    assert str(refused.value).startswith(
        f"--host: {host}:6006 is reachable from other machines but the tensorboard has no "
        "tls and auth; it shows every job's figures"
    )
    assert served == []


def test_insecure_serves_an_open_host_and_warns(
    served: list[tuple[Path, str, int]], tmp_path: Path
) -> None:
    # Act
    with capture_logs() as logs:
        code = _run("--data-dir", str(tmp_path), "--host", "0.0.0.0", "--insecure")

    # Assert
    assert code == 0
    assert served == [(tmp_path / "tensorboard", "0.0.0.0", 6006)]
    assert [e["daemon"] for e in logs if e["event"] == "insecure_listen"] == ["tensorboard"]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--port", "70000"], "--port: expected 0..65535, got 70000"),
        (["--data-dir", "/nonexistent/neuroshard"], "data_dir: /nonexistent/neuroshard is not"),
    ],
)
def test_bad_flags_are_refused_before_serving(
    served: list[tuple[Path, str, int]], argv: list[str], error: str
) -> None:
    # Act
    with pytest.raises(CliError) as refused:
        _run(*argv)

    # Assert
    assert str(refused.value).startswith(error)
    assert refused.value.code == 2
    assert served == []


def test_a_missing_config_is_a_usage_error(
    served: list[tuple[Path, str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Act
    code = main(["tensorboard", "--config", str(tmp_path / "missing.yaml")])

    # Assert
    assert code == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert served == []
    assert issubclass(ExposureRefused, ConfigError)  # a refused host exits 2 the same way
