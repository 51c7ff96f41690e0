"""Agent restart in proxy mode: reconnect to the plugins that were connected, without waiting for them.

A plugin only re-registers when it sees `kubelet.sock` re-created, and some take their time (the upstream stub
retries its restart every 10 s). So the agent records which plugin socket serves which resource, keeps those sockets
at start (it removes every other stale socket, as the kubelet does), and dials them itself. Their later
re-registration is an ordinary reconnect on the same socket. A recovered connection is provisional: the socket may
serve another resource's plugin by now (nothing in the plugin's stream names its resource), so a plugin registering
that socket for another resource disconnects the recovered one (DeviceManager.register).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

log = logging.getLogger("deviceplane.agent.proxy")

STATE_NAME = "deviceplane_proxy_plugins.json"
RECOVER_DIAL_SECONDS = 2.0


class PluginRecord:
    """`<plugin-dir>/deviceplane_proxy_plugins.json`: {resource: plugin socket path} of the connected plugins."""

    def __init__(self, plugin_dir: Path) -> None:
        self.path = plugin_dir / STATE_NAME
        self._saved: dict[str, str] | None = None

    def load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as err:
            if not isinstance(err, FileNotFoundError):
                log.warning("ignoring unreadable %s: %s", self.path, err)
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}

    def save(self, plugins: Mapping[str, str]) -> None:
        """Written only when it changed, atomically (a SIGKILL never leaves half a file)."""
        wanted = dict(sorted(plugins.items()))
        if wanted == self._saved:
            return
        temp = self.path.with_name(f".{STATE_NAME}.tmp")
        try:
            temp.write_text(json.dumps(wanted))
            os.replace(temp, self.path)
        except OSError as err:
            log.warning("cannot record proxied plugins: %s", err)
            return
        self._saved = wanted


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def remove_stale_sockets(plugin_dir: Path, keep: set[str]) -> list[str]:
    """Every socket in the agent's plugin dir but the recorded plugins' (kubelet.sock included)."""
    removed = []
    for entry in plugin_dir.iterdir():
        if str(entry) not in keep and _is_socket(entry):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry.name)
    return removed


async def reconnect(
    recorded: Mapping[str, str],
    register: Callable[[str, str], Awaitable[None]],
    timeout: float = RECOVER_DIAL_SECONDS,
) -> list[str]:
    """Dial every recorded plugin (concurrently); the resources that came back."""

    async def one(resource: str, socket_path: str) -> str | None:
        if not _is_socket(Path(socket_path)):
            return None
        try:
            await asyncio.wait_for(register(resource, socket_path), timeout)
        except Exception as err:  # a plugin that died meanwhile: it re-registers on its own, or never
            log.info("recorded plugin not reachable", extra={"resource": resource, "error": str(err) or repr(err)})
            with contextlib.suppress(OSError):
                os.unlink(socket_path)
            return None
        return resource

    results = await asyncio.gather(*(one(r, s) for r, s in recorded.items()))
    return [r for r in results if r is not None]
