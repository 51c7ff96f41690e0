"""The operator's composition root: the API client, the reconciler, the kopf registry and settings."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

import kopf

from deviceplane.loop_watchdog import LOOP_STALL_SECONDS, LoopWatchdog, loop_watchdog
from deviceplane.operator import kopf_network
from deviceplane.operator.configmaps import ConfigMapHashes
from deviceplane.operator.handlers import IndexView, install
from deviceplane.operator.kube import KubeApi, load_client
from deviceplane.operator.listing import ListingGate
from deviceplane.operator.metrics import OperatorMetrics
from deviceplane.operator.names import MANAGED_SELECTOR
from deviceplane.operator.reconciler import Reconciler
from deviceplane.stop_signals import StopOnceEventLoop

log = logging.getLogger("deviceplane.operator")

WATCHDOG_PREFIX = "deviceplane_operator"  # the loop watchdog's series: deviceplane_operator_event_loop_*


@dataclass(frozen=True)
class OperatorOptions:
    kubeconfig: str | None = None
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    peering: str | None = None  # None: standalone (one replica, no peering objects)
    priority: int = 0  # among peers: the highest works, the others pause (equal ones all pause)
    liveness: str | None = "http://127.0.0.1:8080/healthz"
    metrics_host: str | None = "127.0.0.1"
    metrics_port: int = 9451
    workers: int = 4
    loop_stall_seconds: float = LOOP_STALL_SECONDS  # 0: no watchdog


@dataclass
class Operator:
    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings
    reconciler: Reconciler
    metrics: OperatorMetrics
    options: OperatorOptions

    def run(self) -> None:
        if self.options.metrics_host is not None:
            from prometheus_client import start_http_server

            start_http_server(self.options.metrics_port, addr=self.options.metrics_host, registry=self.metrics.registry)
        # kopf.run on a loop of ours: kopf's own (asyncio.run's) would let a second stop signal interrupt the exit.
        with asyncio.Runner(loop_factory=StopOnceEventLoop) as runner:
            kopf.run(
                loop=runner.get_loop(),
                registry=self.registry,
                settings=self.settings,
                standalone=self.options.peering is None,
                peering_name=self.options.peering,
                clusterwide=not self.options.namespaces,
                namespaces=self.options.namespaces,
                liveness_endpoint=self.options.liveness,
                # kopf would ask getpass for the user name, which fails for a uid without a passwd entry (the image's).
                identity=f"deviceplane-operator@{socket.gethostname()}/{os.getpid()}",  # type: ignore[arg-type]  # kopf.Identity is not public
            )


def settings_for(options: OperatorOptions) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # Events are writes; nothing at rest may write
    settings.scanning.disabled = True  # no CRD/namespace watching: the CRD is installed before the operator
    settings.peering.standalone = options.peering is None
    if options.peering is not None:
        settings.peering.name = options.peering
        settings.peering.priority = options.priority
    # Server-side filtering: only our DaemonSets and their pods stream to us, not every pod in the cluster.
    settings.watching.label_selectors["daemonsets"] = MANAGED_SELECTOR
    settings.watching.label_selectors["pods"] = MANAGED_SELECTOR
    kopf_network.configure(settings)  # timeouts of kopf's lists and watches: see the module
    return settings


def operator_metrics(options: OperatorOptions) -> tuple[OperatorMetrics, LoopWatchdog | None]:
    """The operator's series on one registry: its own, and the loop watchdog's unless `--loop-stall-seconds 0` (kopf's
    loop runs the handlers, the reconciler and the health endpoint: a stall there would say nothing either)."""
    metrics = OperatorMetrics()
    return metrics, loop_watchdog(options.loop_stall_seconds, metrics.registry, WATCHDOG_PREFIX)


def build(options: OperatorOptions) -> Operator:
    api = KubeApi(load_client(options.kubeconfig))
    view = IndexView(
        ConfigMapHashes(api.find_configmap),
        node_gate=ListingGate("nodes", api.list_node_uids),
        pod_gate=ListingGate("plugin pods", lambda: api.list_pod_uids(MANAGED_SELECTOR, options.namespaces)),
    )
    metrics, watchdog = operator_metrics(options)
    reconciler = Reconciler(view, api, metrics, workers=options.workers)
    metrics.track_configs(lambda: list(reconciler.statuses.values()))
    registry = kopf.OperatorRegistry()
    install(registry, view, reconciler, watchdog)
    return Operator(registry, settings_for(options), reconciler, metrics, options)
