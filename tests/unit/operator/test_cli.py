"""`deviceplane operator` flags that are refused before anything starts."""

from __future__ import annotations

import pytest

from deviceplane.cli import main


def test_priority_without_peering_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["operator", "--priority", "5", "--kubeconfig", "/nonexistent"])
    assert "--priority needs --peering NAME" in str(info.value.code)


def test_priority_must_be_an_integer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["operator", "--peering", "p", "--priority", "high"])
    assert info.value.code == 2
    assert "invalid int value: 'high'" in capsys.readouterr().err
