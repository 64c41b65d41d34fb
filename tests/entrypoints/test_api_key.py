"""Where the server's API key comes from: a file, the environment, or (with a warning) the
command line (`guard.resolve_api_key`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from otel_engine.entrypoints.network.guard import ApiKeyError, resolve_api_key

ENV = {"OTEL_ENGINE_API_KEY": "from-env"}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_key_file_gives_its_first_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--api-key-file: the first line, without its line ending; it wins over the
    environment, and nothing is warned."""
    path = tmp_path / "key"
    path.write_text("from-file\n")

    assert "from-file" == resolve_api_key(None, str(path), ENV)
    assert [] == _warnings(caplog)


def test_the_environment_gives_the_key() -> None:
    """OTEL_ENGINE_API_KEY when no flag is given; empty or absent: no key."""
    assert "from-env" == resolve_api_key(None, None, ENV)
    assert resolve_api_key(None, None, {"OTEL_ENGINE_API_KEY": ""}) is None
    assert resolve_api_key(None, None, {}) is None


def test_a_key_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """--api-key works, with a `server.api_key_on_command_line` warning (the key is not in
    it)."""
    with caplog.at_level(logging.WARNING):
        assert "from-flag" == resolve_api_key("from-flag", None, ENV)

    assert ["server.api_key_on_command_line"] == _warnings(caplog)
    assert "from-flag" not in str([vars(r) for r in caplog.records])


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_an_unusable_key_file_is_an_error(tmp_path: Path, content: str | None) -> None:
    """A missing or empty file fails start-up (never a server without its key)."""
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)

    with pytest.raises(ApiKeyError):
        resolve_api_key(None, str(path), ENV)


def test_both_flags_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("k")

    with pytest.raises(ApiKeyError):
        resolve_api_key("k", str(path), ENV)
