"""`deviceplane plugin files|sim`: the reference plugins' command line, with what they share."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from deviceplane import stop_signals
from deviceplane.plugin import files, sim_app
from deviceplane.plugin.plugin import DEFAULT_PLUGIN_DIR, PLUGIN_DIR_ENV, REGISTRY_DIR_ENV, PluginError

PLUGINS = {module.NAME: module for module in (files, sim_app)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plugin", metavar="PLUGIN", required=True)
    for name, module in PLUGINS.items():
        plugin_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        plugin_parser.add_argument(
            "--plugin-dir",
            type=Path,
            default=None,  # as the SDK: $DEVICEPLANE_PLUGIN_DIR, else the kubelet's directory
            help=f"where kubelet.sock is and the plugin's socket goes [${PLUGIN_DIR_ENV}, else {DEFAULT_PLUGIN_DIR}]",
        )
        plugin_parser.add_argument(
            "--registry-dir",
            type=Path,
            help="register through this plugins_registry directory (kubelet plugin watcher) instead of kubelet.sock "
            f"[${REGISTRY_DIR_ENV}, else off]",
        )
        plugin_parser.add_argument(
            "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="[%(default)s]"
        )
        module.add_arguments(plugin_parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(stop_signals.run(PLUGINS[args.plugin].main(args)))
    except (ValueError, PluginError) as err:
        # Bad input or an unusable directory: one line, no traceback, "usage error" exit code like argparse's.
        print(f"deviceplane plugin {args.plugin}: error: {err}", file=sys.stderr)
        return 2
