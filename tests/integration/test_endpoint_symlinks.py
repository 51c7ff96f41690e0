"""Finding 3 of issue 9: a symlink loop or a dangling symlink as the registration endpoint gets the documented
rejection (gRPC Unknown, `invalid endpoint "<name>": ...`), no traceback in the agent's log, nothing registered."""

from __future__ import annotations

import os

import grpc
import pytest

from tests.integration.test_agent_bad_registration import register
from tests.support.procs import AgentProcess


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: (os.symlink("loop-b.sock", d / "loop-a.sock"), os.symlink("loop-a.sock", d / "loop-b.sock")),
         'invalid endpoint "loop-a.sock": symlink loop'),
        (lambda d: os.symlink("self.sock", d / "self.sock"), 'invalid endpoint "self.sock": symlink loop'),
        (lambda d: os.symlink("gone.sock", d / "dangling.sock"),
         'invalid endpoint "dangling.sock": no such socket in'),
    ],
    ids=["loop", "self-loop", "dangling"],
)  # fmt: skip
def test_symlink_endpoints_are_rejected_cleanly(agent: AgentProcess, make, message: str) -> None:  # type: ignore[no-untyped-def]
    make(agent.plugin_dir)
    endpoint = message.split('"')[1]
    err = register(agent, endpoint=endpoint)
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert str(err.details()).startswith(message), err.details()
    assert agent.resources() == {}
    log = agent.log()
    assert "Traceback" not in log and "Unexpected" not in log
    assert "registration rejected" in log
    assert agent.healthy()
