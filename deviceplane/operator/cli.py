"""`deviceplane operator`: reconcile DevicePluginConfigs into plugin DaemonSets (all namespaces unless told)."""

from __future__ import annotations

import argparse
import logging
import os
from urllib.parse import urlparse

from deviceplane import logs
from deviceplane.agent.cli import add_loop_stall_argument, http_address


def _url(text: str) -> str:
    parsed = urlparse(text)
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise argparse.ArgumentTypeError(f"invalid URL {text!r}: expected http://HOST:PORT/PATH")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", default=None, help="[in-cluster service account, else $KUBECONFIG]")
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace: its DevicePluginConfigs, DaemonSets, pods and ConfigMaps; nodes stay "
        "cluster-wide (repeatable) [all namespaces]",
    )
    parser.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="coordinate replicas through kopf peering object NAME (manifests/extras/peering/) [off: run one replica]",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="with --peering: the replica with the highest priority works, the others pause; replicas with the "
        "same priority all pause, so give each its own [0]",
    )
    parser.add_argument(
        "--liveness",
        type=_url,
        default="http://127.0.0.1:8080/healthz",
        help="kopf's health endpoint [%(default)s]",
    )
    parser.add_argument(
        "--metrics-addr", type=http_address, default="127.0.0.1:9451", help="Prometheus /metrics [%(default)s]"
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not serve metrics")
    parser.add_argument("--workers", type=int, default=4, help="configs reconciled concurrently [%(default)s]")
    add_loop_stall_argument(parser)
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="[%(default)s]"
    )


def run(args: argparse.Namespace) -> int:
    if args.priority is not None and args.peering is None:
        raise SystemExit(
            "deviceplane operator: --priority needs --peering NAME (without peering there is no one to yield to)"
        )
    if args.kubeconfig:
        # kopf's login goes through the kubernetes client, which reads $KUBECONFIG when it is imported (next line).
        os.environ["KUBECONFIG"] = args.kubeconfig
    from deviceplane.operator.app import OperatorOptions, build  # kopf and the client load only here

    logs.setup(args.log_level)
    if args.log_level != "debug":
        # kopf logs every handler call at info; ours say what was decided.
        logging.getLogger("kopf").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # a line per health probe otherwise
        # But pausing for a peer and resuming are worth a line each.
        logging.getLogger("kopf._core.engines.peering").setLevel(logging.INFO)
        # kopf logs every failed attempt of its lists and watches at error level: one line a minute says it all.
        from deviceplane.operator.kopf_network import quiet_request_failures

        quiet_request_failures()
    host, _, port = args.metrics_addr.rpartition(":")
    options = OperatorOptions(
        kubeconfig=args.kubeconfig,
        namespaces=tuple(args.namespace),
        peering=args.peering,
        priority=args.priority or 0,
        liveness=args.liveness,
        metrics_host=None if args.no_metrics else host,
        metrics_port=int(port),
        workers=max(1, args.workers),
        loop_stall_seconds=args.loop_stall_seconds,
    )
    build(options).run()
    return 0
