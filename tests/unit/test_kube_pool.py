"""One rule for both programs' connection pools (deviceplane/kube_pool.py): a failure of the network drops the pool,
an answer does not. The rule over exception types and how they were raised; then both programs' real clients against
a real HTTP server behind the TCP proxy (tests/support/tcp_proxy.py), which counts the connections: after an answer
the connections are reused, after a body cut short they are all dialled anew."""

from __future__ import annotations

import asyncio
import http.client
import http.server
import inspect
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException, ApiValueError

from deviceplane.agent.kube.client import KubeApi as AgentApi
from deviceplane.agent.kube.client import api_client
from deviceplane.agent.kube.errors import KubeError
from deviceplane.kube_pool import PoolDrop, failed_on_the_network
from deviceplane.operator.kube import KubeApi as OperatorApi
from deviceplane.operator.kube import load_client
from tests.support.tcp_proxy import TcpProxy

# -- the rule -------------------------------------------------------------------------------------------------------

URLLIB3_ERRORS = [
    cls
    for _, cls in inspect.getmembers(urllib3.exceptions, inspect.isclass)
    if issubclass(cls, urllib3.exceptions.HTTPError)
]
NETWORK = [
    *URLLIB3_ERRORS,
    http.client.IncompleteRead,
    http.client.RemoteDisconnected,
    http.client.BadStatusLine,
    ConnectionResetError,
    BrokenPipeError,
    TimeoutError,
    socket.timeout,
    ssl.SSLError,
    OSError,
]
# What a body that arrived whole but does not parse raises, and what else is no failure of the network.
NOT_NETWORK = [json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError, RuntimeError, ApiValueError]


def bare(cls: type[BaseException]) -> BaseException:
    return cls.__new__(cls)  # constructors differ; the class is what is judged


def raised_over(inner: BaseException, link: str) -> KubeError:
    """A KubeError raised while `inner` was handled: `from` it, plainly during it, or `from None`."""
    try:
        try:
            raise inner
        except BaseException as caught:
            if link == "from":
                raise KubeError("wrapped") from caught
            if link == "during":
                raise KubeError("wrapped")  # noqa: B904 - the implicit context is what is tested
            raise KubeError("wrapped") from None
    except KubeError as outer:
        return outer
    raise AssertionError("unreachable")


@given(st.sampled_from(NETWORK))
def test_a_failure_of_the_network_drops_the_pool(cls: type[BaseException]) -> None:
    assert failed_on_the_network(bare(cls))


@given(st.sampled_from(NOT_NETWORK))
def test_a_body_that_does_not_parse_and_other_errors_do_not(cls: type[BaseException]) -> None:
    assert not failed_on_the_network(bare(cls))


@given(st.sampled_from(NETWORK + NOT_NETWORK), st.lists(st.sampled_from(["from", "during", "from None"]), max_size=3))
def test_an_error_counts_as_what_it_was_raised_from(cls: type[BaseException], links: list[str]) -> None:
    """The agent's KubeError from a ReadTimeoutError is a failure of the network; one `from None` (an undecodable
    watch event) hides what was being handled, as its traceback does."""
    err = bare(cls)
    for link in links:
        err = raised_over(err, link)
    assert failed_on_the_network(err) == (cls in NETWORK and "from None" not in links)


@given(st.integers(100, 599), st.sampled_from(NETWORK))
def test_an_api_answer_does_not_drop_the_pool_whatever_was_handled_around_it(
    status: int, cls: type[BaseException]
) -> None:
    """A 5xx or a 429 came as HTTP over a working connection; raised while a network error was handled (a retry
    that got an answer), it is still an answer."""
    try:
        raise bare(cls)
    except BaseException:
        answer = ApiException(status=status, reason="answered")
    assert not failed_on_the_network(answer)
    assert not failed_on_the_network(raised_over(answer, "from"))


def test_the_clients_api_exception_without_a_status_around_an_ssl_error_is_the_ssl_error() -> None:
    """The official client turns urllib3's SSLError of a request into an ApiException of status 0 (rest.py)."""
    try:
        try:
            raise urllib3.exceptions.SSLError("EOF occurred in violation of protocol")
        except urllib3.exceptions.SSLError as e:
            raise ApiException(status=0, reason=f"SSLError\n{e}")  # noqa: B904 - as the client raises it
    except ApiException as wrapped:
        assert failed_on_the_network(wrapped)


def pools_after(err: BaseException) -> int:
    """How many connection pools a PoolManager keeps after `err` left a PoolDrop (re-raised as it was)."""
    manager = urllib3.PoolManager()
    manager.connection_from_url("http://127.0.0.1:9/")  # a pool, no connection made
    with pytest.raises(type(err)) as left, PoolDrop(manager):
        raise err
    assert left.value is err
    return len(manager.pools)


def test_pool_drop_clears_the_pool_manager_on_a_failure_of_the_network_only() -> None:
    assert pools_after(urllib3.exceptions.ProtocolError("Connection broken")) == 0
    assert pools_after(raised_over(urllib3.exceptions.ReadTimeoutError(None, None, "Read timed out."), "from")) == 0
    assert pools_after(json.JSONDecodeError("Expecting value", "{", 1)) == 1
    assert pools_after(ApiException(status=503, reason="Service Unavailable")) == 1
    # A watch's generator closed (or a task cancelled) while a network error is handled around it: no failure.
    assert pools_after(raised_over_base(GeneratorExit(), urllib3.exceptions.ProtocolError("cut"))) == 1


def raised_over_base(err: BaseException, handled: BaseException) -> BaseException:
    try:
        try:
            raise handled
        except BaseException:
            raise err  # noqa: B904 - the implicit context is what is tested
    except BaseException as outer:
        return outer


# -- both programs' clients against a real server -------------------------------------------------------------------


class Answers(http.server.BaseHTTPRequestHandler):
    """Answers a GET by the name at the end of its path: `malformed` (200, a body that is whole but not JSON),
    `status-<code>` (that status, a Kubernetes Status body), `cut` (200, the connection closed 10 bytes into a
    100-byte body); any other name, 200 `{}`. Keeps connections open between requests, as the API server does."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        name = self.path.split("?", 1)[0].rsplit("/", 1)[-1]
        if name == "cut":
            self._head(200, 100)
            self.wfile.write(b'{"kind": "')
            self.close_connection = True
            return
        status = int(name.removeprefix("status-")) if name.startswith("status-") else 200
        body = b'{"kind": "Node", "metadata": {' if name == "malformed" else b"{}"
        if status != 200:
            body = json.dumps({"kind": "Status", "code": status, "message": name}).encode()
        self._head(status, len(body))
        self.wfile.write(body)

    def _head(self, status: int, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    """A proxy in front of an `Answers` server: its `accepted` counts the clients' connections."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    p = TcpProxy(server.server_address[1])
    yield p
    p.close()
    server.shutdown()
    server.server_close()


def kubeconfig(proxy: TcpProxy, path: Path) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://{proxy.address}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(json.dumps(config))
    return path


def clients(program: str, path: Path) -> tuple[Callable[[str], Any], CoreV1Api]:
    """One of the program's own reads (by the name it asks for), and a raw client over the same pool."""
    if program == "agent":
        agent = AgentApi(api_client(path))
        return agent.get_node, agent.core
    operator_client = load_client(str(path))
    operator = OperatorApi(operator_client, request_timeout=5.0)
    return lambda name: asyncio.run(operator.get_daemonset("ns", name)), CoreV1Api(operator_client)


def dialled(proxy: TcpProxy, core: CoreV1Api, count: int) -> int:
    """How many new connections `count` requests held at once took (each answer then read and released)."""
    before = proxy.accepted
    held = [core.read_node("fine", _preload_content=False) for _ in range(count)]
    for response in held:
        response.read()
        response.release_conn()
    return proxy.accepted - before


@pytest.mark.parametrize("program", ["agent", "operator"])
@pytest.mark.parametrize(
    ("answer", "error", "drops"),
    [
        ("malformed", "JSONDecodeError", False),
        ("status-429", "429", False),
        ("status-503", "503", False),
        ("cut", "ProtocolError", True),
    ],
)
def test_a_pool_is_dropped_after_a_failure_of_the_network_not_after_an_answer(
    program: str, answer: str, error: str, drops: bool, proxy: TcpProxy, tmp_path: Path
) -> None:
    """Two connections idle in the pool, one failed read, then two requests at once: after an answer (an error
    status, a body whole but malformed) both reuse the idle connections; after a body cut short both dial anew
    (one would anyway: the cut connection is closed). The agent dropped its pool after a malformed body, and the
    operator kept it after a body cut short."""
    read, core = clients(program, kubeconfig(proxy, tmp_path / "kubeconfig"))
    assert dialled(proxy, core, 2) == 2
    with pytest.raises(Exception) as failed:
        read(answer)
    assert error in f"{type(failed.value).__name__}: {failed.value}"
    assert dialled(proxy, core, 2) == (2 if drops else 0)
