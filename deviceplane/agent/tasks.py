"""What a long-lived task of the agent is, for the supervisor (agent.supervisor.Supervisor) and the composition root."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

TaskFactory = Callable[[], Awaitable[None]]
