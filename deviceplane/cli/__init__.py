"""`deviceplane` command line: each subcommand's module adds its own parser and runs it.

Subcommand modules are imported lazily so that `deviceplane plugin ...` does not pay for kubernetes/kopf imports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

# grpc's EventEngine client and listener (default in grpcio 1.85) hand each completion through more threads than the
# older poller: measured here, half the context switches per call and 0.1-0.2 ms less latency per proxied Allocate
# (benchmarks/proxy.py --env). grpc reads this once, when it is first imported, which the subcommands below do
# lazily; an explicit setting in the environment wins.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "agent": ("deviceplane.agent.cli", "run the node agent (device manager)"),
    "plugin": ("deviceplane.plugin.cli", "run a reference device plugin"),
    "demo": ("deviceplane.cli.demo", "run the agent with reference plugins and show the result"),
    "operator": ("deviceplane.operator.cli", "run the DevicePluginConfig operator"),
    "status": ("deviceplane.cli.status", "show the local agent's conditions, devices, health, NUMA nodes and owners"),
}


# A third-party module a subcommand needs -> the extra that installs it (the base install has none of them).
EXTRAS = {"rich": "demo", "kopf": "operator", "kubernetes": "cluster"}


def _import(command: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        extra = EXTRAS.get((err.name or "").partition(".")[0])
        if extra is None:
            raise
        raise SystemExit(
            f"deviceplane {command}: needs {err.name}, which is not installed: pip install 'deviceplane[{extra}]'"
        ) from None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deviceplane", description="Kubernetes device plugins, done right.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported; the others get a placeholder parser for --help.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = _import(name, module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.version:
        from deviceplane import __version__

        print(__version__)
        return 0
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The process's entry point (the `deviceplane` script, `python -m deviceplane`): `main`, then `exit_process`."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """Exit with `code`, without finalizing the interpreter while a daemon thread still runs.

    Such a thread is a call left behind on purpose (`aio.off_loop`: a request to an API server that does not answer,
    a plugin hook that never returns). CPython 3.11 ends a daemon thread that wakes during finalization with
    pthread_exit, which can abort the process: an agent stopped during its API server check died of SIGABRT (exit
    -6) instead of exiting 0. Logs and streams are flushed first; atexit handlers are skipped then (none of ours
    needs one)."""
    if any(thread.daemon and thread.is_alive() for thread in threading.enumerate()):
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to save
                stream.flush()
        os._exit(code)
    raise SystemExit(code)
