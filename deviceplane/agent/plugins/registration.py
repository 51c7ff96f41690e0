"""The v1beta1.Registration service on `<plugin-dir>/kubelet.sock` (spec §4.2)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import grpc

from deviceplane.agent.plugins.contracts import PluginHandler, RegistrationError
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.typed_grpc import Context
from deviceplane.core.constants import CHECKPOINT_NAME, SUPPORTED_VERSIONS
from deviceplane.core.names import (
    invalid_resource_name_error,
    is_extended_resource_name,
    unsupported_version_error,
    validate_endpoint_name,
)

log = logging.getLogger("deviceplane.agent.plugins.registration")


def resolve_endpoint(plugin_dir: Path, endpoint: str) -> str:
    """The socket path a RegisterRequest names, or RegistrationError.

    Stricter than the kubelet, which joins whatever it is given to the directory: the endpoint must be a plain file
    name of a unix socket that is really inside the plugin directory (no `..`, no absolute path, no symlink out).
    """
    problem = validate_endpoint_name(endpoint)
    if problem is not None:
        raise RegistrationError(problem)
    path = plugin_dir / endpoint
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise RegistrationError(f'invalid endpoint "{endpoint}": no such socket in {plugin_dir}') from None
    except OSError as err:
        raise RegistrationError(f'invalid endpoint "{endpoint}": {err.strerror}') from None
    if stat.S_ISLNK(info.st_mode):
        try:
            real = Path(os.path.realpath(path, strict=True))
        except FileNotFoundError:
            raise RegistrationError(f'invalid endpoint "{endpoint}": no such socket in {plugin_dir}') from None
        except OSError as err:  # ELOOP: a symlink loop
            problem = "symlink loop" if err.errno == errno.ELOOP else err.strerror
            raise RegistrationError(f'invalid endpoint "{endpoint}": {problem}') from None
        if real.parent != Path(os.path.realpath(plugin_dir)):
            raise RegistrationError(f'invalid endpoint "{endpoint}": symlink leads outside {plugin_dir}')
        try:
            info = os.stat(real)
        except OSError as err:  # replaced since realpath looked
            raise RegistrationError(f'invalid endpoint "{endpoint}": {err.strerror}') from None
    if not stat.S_ISSOCK(info.st_mode):
        raise RegistrationError(f'invalid endpoint "{endpoint}": not a unix socket')
    return str(path)


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, handler: PluginHandler, plugin_dir: Path, on_attempt: Callable[[str], None]) -> None:
        self._handler = handler
        self._plugin_dir = plugin_dir
        self._on_attempt = on_attempt

    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.Empty:
        # Counted before validation, as upstream: rejected attempts show up too.
        self._on_attempt(request.resource_name)
        try:
            if request.version not in SUPPORTED_VERSIONS:
                raise RegistrationError(unsupported_version_error(request.version))
            if not is_extended_resource_name(request.resource_name):
                raise RegistrationError(invalid_resource_name_error(request.resource_name))
            socket_path = resolve_endpoint(self._plugin_dir, request.endpoint)
            await self._handler.register(request.resource_name, socket_path)
        except RegistrationError as err:
            log.warning(
                "registration rejected",
                extra={"resource": request.resource_name, "endpoint": request.endpoint, "error": str(err)},
            )
            # Upstream returns plain Go errors, which reach the plugin as status Unknown with the message.
            await context.abort(grpc.StatusCode.UNKNOWN, str(err))
        except Exception as err:  # a bug: the plugin gets a clear answer, the log the traceback
            endpoint = request.endpoint
            log.exception("registration failed", extra={"resource": request.resource_name, "endpoint": endpoint})
            await context.abort(grpc.StatusCode.UNKNOWN, f"internal error: {type(err).__name__}: {err}")
        return pb.Empty()


def cleanup_plugin_dir(plugin_dir: Path) -> list[str]:
    """Remove stale sockets at start, keeping the checkpoint, directories and other files (CleanupPluginDirectory).

    As upstream, an entry is judged by what it points to (`os.Stat`): a symlink to a socket is removed too (the link,
    never its target), and a dangling one is logged and kept."""
    removed: list[str] = []
    for entry in plugin_dir.iterdir():
        if entry.name == CHECKPOINT_NAME:
            continue
        try:
            mode = entry.stat().st_mode
        except OSError as err:
            log.warning("plugin directory entry left alone, cannot stat it: %s: %s", entry, err)
            continue
        if not stat.S_ISSOCK(mode):
            continue
        try:
            entry.unlink()
        except OSError as err:
            log.warning("could not remove stale socket %s: %s", entry, err)
        else:
            removed.append(entry.name)
    return removed
