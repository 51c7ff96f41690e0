"""`deviceplane plugin files`: the classic "cola" plugin - every regular file in a directory is a device.

Decisions (also in the README):
- device id = file name; names starting with "." are skipped, so tools can write a temp file and rename it in;
- regular files only (symlinks to regular files count); directories, sockets and dangling links are ignored;
- a file the plugin cannot read is still a device: the plugin never reads it, the container runtime bind-mounts it
  as root; a warning names it once, so an operator can tell;
- a file whose name is not valid UTF-8 is skipped, with a warning once: device ids are protobuf strings, so it cannot
  be offered, and it must not stop the plugin from offering the others;
- the directory is watched (inotify), re-listed on every change: creating or removing a file updates the device list
  within a fraction of a second;
- a list too large for one ListAndWatch message (over 4 MiB: some 20,000 names of 200 characters) is not offered:
  an error says so, and the plugin keeps offering the last list that fit (none, if it started that way) until the
  directory shrinks. Sent anyway, the kubelet would drop the stream and keep the old devices, unhealthy, for good.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import threading
from pathlib import Path

from deviceplane.aio import cancel_and_wait
from deviceplane.core.names import is_utf8
from deviceplane.plugin.devices import DeviceListTooLarge
from deviceplane.plugin.models import Allocation, Device, Mount
from deviceplane.plugin.plugin import DevicePlugin
from deviceplane.plugin.supervise import keep_running
from deviceplane.plugin.watch import dir_changes

log = logging.getLogger("deviceplane.plugin.files")

NAME = "files"
# The API server's rule for a container's env var name (IsEnvVarName): a pod with another name is refused.
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
HELP = "every regular file in a directory is a device (the 'cola' plugin)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resource", default="example.com/cola", help="extended resource name [%(default)s]")
    parser.add_argument("--dir", required=True, type=Path, help="directory whose files are the devices")
    parser.add_argument("--env", default="COLA_DEVICES", help="env var listing allocated ids [%(default)s]")
    parser.add_argument(
        "--mount-dir", default="/var/run/cola", help="where the chosen files appear in the container [%(default)s]"
    )


def list_devices(directory: Path, warned: set[str]) -> list[Device]:
    """The devices `directory` holds right now, sorted by id.

    `warned`: names already warned about (unreadable, not UTF-8), kept to the names present so that a file which
    comes back is reported again.
    """
    devices = []
    present = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            present.add(entry.name)
            if entry.name.startswith(".") or not _is_regular_file(entry):
                continue
            if not is_utf8(entry.name):
                _warn_once(warned, entry.name, "%r: the name is not valid UTF-8; not offered", os.fsencode(entry.path))
                continue
            if not os.access(entry.path, os.R_OK):
                _warn_once(
                    warned, entry.name, "%s is not readable by the plugin; it is still offered as a device", entry.path
                )
            devices.append(Device(entry.name))
    warned.intersection_update(present)
    devices.sort(key=lambda d: d.id)
    return devices


def _is_regular_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()  # follows symlinks: a link to a regular file counts
    except OSError:
        return False


def _warn_once(warned: set[str], name: str, message: str, *args: object) -> None:
    if name not in warned:
        warned.add(name)
        log.warning(message, *args)


class FilesPlugin:
    def __init__(
        self,
        resource: str,
        directory: Path,
        *,
        env: str = "COLA_DEVICES",
        mount_dir: str = "/var/run/cola",
        plugin_dir: Path | None = None,
        registry_dir: Path | None = None,
    ) -> None:
        if not _ENV_NAME.fullmatch(env):
            raise ValueError(f"--env {env!r}: not an environment variable name (letters, digits, '_', '-', '.')")
        if not mount_dir.startswith("/"):
            raise ValueError(f"--mount-dir {mount_dir!r}: must be an absolute path in the container")
        if not directory.exists():
            raise ValueError(f"--dir {directory}: no such directory")
        if not directory.is_dir():
            raise ValueError(f"--dir {directory}: not a directory")
        self.directory = directory.absolute()
        self.env = env
        self.mount_dir = mount_dir.rstrip("/")
        self._warned: set[str] = set()
        self._too_large = False
        try:
            devices = list_devices(self.directory, self._warned)
        except OSError as err:
            raise ValueError(f"--dir {directory}: cannot list: {err.strerror}") from None
        self.plugin = DevicePlugin(resource, allocate=self.allocate, plugin_dir=plugin_dir, registry_dir=registry_dir)
        self._offer(devices)

    def allocate(self, device_ids: list[str]) -> Allocation:
        return Allocation(
            envs={self.env: ",".join(device_ids)},
            mounts=[Mount(f"{self.mount_dir}/{i}", str(self.directory / i), read_only=True) for i in device_ids],
        )

    def rescan(self) -> None:
        try:
            devices = list_devices(self.directory, self._warned)
        except OSError as err:  # the directory itself went away: no devices until it is back
            log.warning("cannot list %s: %s", self.directory, err.strerror)
            devices = []
        self._offer(devices)

    def _offer(self, devices: list[Device]) -> None:
        try:
            self.plugin.set_devices(devices)
        except DeviceListTooLarge as err:
            if not self._too_large:  # once per episode: the directory is re-listed on every change and tick
                log.error(
                    "%s: %s; still offering the %d devices of the last list that fit",
                    self.directory,
                    err,
                    len(self.plugin.devices),
                )
            self._too_large = True
            return
        if self._too_large:
            log.info("%s: the device list fits in a message again: %d devices", self.directory, len(devices))
        self._too_large = False

    async def serve(self) -> None:
        stop = threading.Event()
        watcher = asyncio.create_task(keep_running(f"{self.directory} watch", lambda: self._watch(stop)))
        try:
            await self.plugin.serve()
        finally:
            stop.set()
            await cancel_and_wait([watcher])

    async def _watch(self, stop: threading.Event) -> None:
        async for _ in dir_changes(self.directory, stop):
            try:
                self.rescan()  # a re-list, not event bookkeeping: cannot drift from the directory
            except Exception:  # one failed rescan must not end the watch: the next change or tick retries
                log.exception("rescanning %s failed", self.directory)


async def main(args: argparse.Namespace) -> int:
    plugin = FilesPlugin(
        args.resource,
        args.dir,
        env=args.env,
        mount_dir=args.mount_dir,
        plugin_dir=args.plugin_dir,
        registry_dir=args.registry_dir,
    )
    log.info("%s: %d devices from %s", args.resource, len(plugin.plugin.devices), plugin.directory)
    await plugin.serve()
    return 0
