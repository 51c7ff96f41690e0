"""`deviceplane plugin files`: the classic "cola" plugin - every regular file in a directory is a device.

Decisions (also in the README):
- device id = file name; names starting with "." are skipped, so tools can write a temp file and rename it in;
- regular files only (symlinks to regular files count); directories, sockets and dangling links are ignored;
- a file the plugin cannot read is still a device: the plugin never reads it, the container runtime bind-mounts it
  as root; a warning names it once, so an operator can tell;
- the directory is watched (inotify), re-listed on every change: creating or removing a file updates the device list
  within a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from pathlib import Path

from deviceplane.aio import cancel_and_wait
from deviceplane.plugin.models import Allocation, Device, Mount
from deviceplane.plugin.plugin import DevicePlugin
from deviceplane.plugin.watch import dir_changes

log = logging.getLogger("deviceplane.plugin.files")

NAME = "files"
HELP = "every regular file in a directory is a device (the 'cola' plugin)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resource", default="example.com/cola", help="extended resource name [%(default)s]")
    parser.add_argument("--dir", required=True, type=Path, help="directory whose files are the devices")
    parser.add_argument("--env", default="COLA_DEVICES", help="env var listing allocated ids [%(default)s]")
    parser.add_argument(
        "--mount-dir", default="/var/run/cola", help="where the chosen files appear in the container [%(default)s]"
    )


def list_devices(directory: Path, warned: set[str]) -> list[Device]:
    """The devices `directory` holds right now, sorted by id; `warned`: unreadable files already reported."""
    devices = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if not entry.is_file():  # follows symlinks: a link to a regular file counts
                    continue
            except OSError:
                continue
            if entry.name not in warned and not os.access(entry.path, os.R_OK):
                warned.add(entry.name)
                log.warning("%s is not readable by the plugin; it is still offered as a device", entry.path)
            devices.append(Device(entry.name))
    devices.sort(key=lambda d: d.id)
    return devices


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
        if not directory.exists():
            raise ValueError(f"--dir {directory}: no such directory")
        if not directory.is_dir():
            raise ValueError(f"--dir {directory}: not a directory")
        self.directory = directory.absolute()
        self.env = env
        self.mount_dir = mount_dir.rstrip("/")
        self._warned: set[str] = set()
        try:
            devices = list_devices(self.directory, self._warned)
        except OSError as err:
            raise ValueError(f"--dir {directory}: cannot list: {err.strerror}") from None
        self.plugin = DevicePlugin(
            resource, devices, allocate=self.allocate, plugin_dir=plugin_dir, registry_dir=registry_dir
        )

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
        self._warned.intersection_update(d.id for d in devices)
        self.plugin.set_devices(devices)

    async def serve(self) -> None:
        stop = threading.Event()
        watcher = asyncio.create_task(self._watch(stop))
        try:
            await self.plugin.serve()
        finally:
            stop.set()
            await cancel_and_wait([watcher])

    async def _watch(self, stop: threading.Event) -> None:
        async for _ in dir_changes(self.directory, stop):
            self.rescan()  # a re-list, not event bookkeeping: cannot drift from the directory


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
