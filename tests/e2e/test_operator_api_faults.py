"""The operator's Kubernetes client (deviceplane/operator/kube.py) against a real API server behind a TCP proxy
(tests/support/tcp_proxy.py) that stops answering, on open connections and new ones alike: each request is sent
once and fails within its timeout, urllib3 logs nothing of its own, and the reconciler takes the failure as
transient (its per-config backoff is the one retry). With urllib3's default retries, a read or a DaemonSet
replace was sent 4 times, on 4 connections, each after a timeout (30 s in production) and with a WARNING.

After an outage, the connections idle in the client's pool are dropped at the first failure, so requests made at
once do not each wait out a dead one. kopf's own requests (its lists and watches) go through aiohttp, not urllib3:
their timeouts and retries are set in deviceplane/operator/kopf_network.py (tests/e2e/test_operator_api_outage.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import CoreV1Api
from urllib3.exceptions import ReadTimeoutError

from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator.kube import KubeApi, load_client
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.reconciler import is_transient
from deviceplane.operator.render import Owner, render_daemonset
from tests.support.tcp_proxy import TcpProxy, silenced_pooled_connections

from .cluster import Cluster

TIMEOUT = 1.0  # seconds per request here (30 in production): the test waits for each


@pytest.fixture
def proxy(cluster: Cluster) -> Iterator[TcpProxy]:
    p = TcpProxy(cluster.apiserver_port)
    yield p
    p.close()


def operator_api(cluster: Cluster, proxy: TcpProxy, directory: Path) -> KubeApi:
    """The operator's client, as `deviceplane operator --kubeconfig` builds it, as admin through the proxy."""
    assert cluster.pki is not None
    path = directory / "operator.kubeconfig"
    kubeconfig = cluster.pki.kubeconfig(f"https://{proxy.address}", "admin", ("system:masters",), path=path)
    return KubeApi(load_client(str(kubeconfig)), request_timeout=TIMEOUT)


def test_a_request_to_an_api_server_that_stopped_answering_is_sent_once_without_urllib3_warnings(
    cluster: Cluster, proxy: TcpProxy, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = operator_api(cluster, proxy, tmp_path)
    key = ConfigKey(namespace, "faults")
    daemonset = render_daemonset(
        Owner(key, "00000000-0000-0000-0000-000000000000"),
        DevicePluginConfigSpec.model_validate({"resourceName": "example.com/faults", "image": "img"}),
    )
    daemonset["metadata"]["resourceVersion"] = "1"
    with pytest.raises(Exception) as absent:
        asyncio.run(api.get_daemonset(namespace, key.daemonset))
    assert getattr(absent.value, "status", None) == 404, "the client does not reach the API server through the proxy"
    assert proxy.accepted == 1

    assert proxy.blackhole(new_connections=True) == 1
    caplog.set_level(logging.DEBUG, logger="urllib3")
    requests: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("read", lambda: api.get_daemonset(namespace, key.daemonset)),  # on the open, now silent, connection
        ("replace", lambda: api.replace_daemonset(daemonset)),  # on a new one (the silent one was closed)
        ("status patch", lambda: api.patch_status(key, {"observedGeneration": 1})),
    ]
    for what, request in requests:
        connections, records = proxy.accepted, len(caplog.records)
        started = time.monotonic()
        with pytest.raises(Exception) as failed:
            asyncio.run(request())  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        assert is_transient(failed.value), f"{what}: {failed.value!r} would not be retried by the reconciler"
        retried = [r.getMessage() for r in caplog.records[records:] if r.levelno >= logging.WARNING]
        assert retried == [], f"{what}: urllib3 retried it: {retried}"
        assert proxy.accepted - connections <= 1, f"{what}: {proxy.accepted - connections} connections for one request"
        assert elapsed < 3 * TIMEOUT, f"{what}: failed after {elapsed:.1f} s, for a {TIMEOUT} s timeout"


def test_after_one_request_timed_out_requests_at_once_do_not_take_the_other_dead_pooled_connections(
    cluster: Cluster, proxy: TcpProxy, namespace: str, tmp_path: Path
) -> None:
    """Connections idle in the client's pool during an outage stay silent after it (tcp_proxy's restore: as after a
    lost NAT entry), and urllib3 cannot tell before sending on one. One request after another takes a new connection
    after a failure (the pool is a stack, the failed connection's place goes on top), but requests at once - the
    reconciler's workers - took the dead ones, each to wait out its timeout. After the first timeout the pool is now
    dropped, so they all dial new connections."""
    assert cluster.pki is not None
    path = tmp_path / "operator.kubeconfig"
    api_client = load_client(str(cluster.pki.kubeconfig(f"https://{proxy.address}", "admin", ("system:masters",),
                                                        path=path)))  # fmt: skip
    api = KubeApi(api_client, request_timeout=TIMEOUT)
    core = CoreV1Api(api_client)
    silenced_pooled_connections(proxy, lambda: core.list_namespace(_preload_content=False), 3)
    with pytest.raises(Exception) as first:
        asyncio.run(api.get_daemonset(namespace, "absent"))
    assert is_transient(first.value), repr(first.value)

    async def three_at_once() -> list[BaseException | dict[str, Any]]:
        return await asyncio.gather(*(api.get_daemonset(namespace, "absent") for _ in range(3)), return_exceptions=True)

    answers = asyncio.run(three_at_once())
    assert all(getattr(a, "status", None) == 404 for a in answers), f"not all answered: {answers!r}"


BLOB = 512 * 1024  # bytes of a ConfigMap's data: an answer of many TLS records
PART = 64 * 1024  # bytes of that answer that arrive: past its headers, short of its end


def test_after_an_answer_went_silent_mid_body_requests_at_once_do_not_take_the_other_dead_pooled_connections(
    cluster: Cluster, proxy: TcpProxy, namespace: str, tmp_path: Path
) -> None:
    """An answer whose connection goes silent after its headers and part of its body fails while the body is read,
    after the request returned: a failure of the network all the same, and the pool's other idle connections went
    through it too. The pool was dropped only when the request itself failed, so requests at once afterwards (the
    reconciler's workers) took the other dead connections, each to wait out its timeout. Now they dial anew."""
    blob = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "blob"}, "data": {"blob": "x" * BLOB}}
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(blob))  # not applied: no annotation copy
    assert cluster.pki is not None
    path = tmp_path / "operator.kubeconfig"
    api_client = load_client(str(cluster.pki.kubeconfig(f"https://{proxy.address}", "admin", ("system:masters",),
                                                        path=path)))  # fmt: skip
    timeout = 4.0  # the requests at once are held to half of it
    api = KubeApi(api_client, request_timeout=timeout)
    core = CoreV1Api(api_client)
    silenced_pooled_connections(proxy, lambda: core.list_namespace(_preload_content=False), 4)
    proxy.blackhole_newest_after(PART)  # the connection the next request takes
    with pytest.raises(ReadTimeoutError) as lost:
        asyncio.run(api.find_configmap(namespace, "blob"))
    assert is_transient(lost.value), repr(lost.value)
    assert proxy.accepted == 4, "the answer did not come on the pooled connection"

    async def three_at_once() -> list[BaseException | dict[str, Any]]:
        return await asyncio.gather(*(api.get_daemonset(namespace, "absent") for _ in range(3)), return_exceptions=True)

    started = time.monotonic()
    answers = asyncio.run(three_at_once())
    elapsed = time.monotonic() - started
    print(f"three reads at once: {elapsed:.2f} s")
    assert all(getattr(a, "status", None) == 404 for a in answers), f"not all answered: {answers!r}"
    assert proxy.accepted == 4 + 3, "not each on a new connection"
    assert elapsed < timeout / 2, f"{elapsed:.1f} s for three reads at once"
