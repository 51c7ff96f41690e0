"""When deviceplane's programs drop their Kubernetes client's connection pool: after a failure of the network, never
after an answer.

The rule, one for the agent (deviceplane/agent/kube/client.py) and the operator (deviceplane/operator/kube.py): a
request that fails on the network - urllib3's errors (a connect or read timeout, a protocol error, a connection reset,
a body cut short: `IncompleteRead`), http.client's and the socket's - while it is sent, while its answer's body is
read, or while a watch's stream is read (its read timeout included), drops the urllib3 pool. An exception raised from
such a failure (the agent's `KubeError`, the client's `ApiException` without a status around an `SSLError`) counts as
that failure. An answer does not: an `ApiException` with a status came as HTTP (a 5xx or a 429 too), over a
connection that works; nor does a body that arrived whole but does not parse (a JSON decode error).

Why: urllib3 cannot tell that an idle pooled connection is dead before it sends on it. The pool's other idle
connections went through whatever broke this one (a lost NAT entry, a blackholed peer), and may be as dead, silently:
requests made at once afterwards (the agent's publishers, the operator's reconciler workers) would each take one and
wait out a whole read timeout. Dropped, the next requests dial new connections. A request after another takes a new
connection after a failure anyway (the pool is a stack; the failed connection's place is on top): the drop is for the
requests at once. Dropping it after an answer would only cost new handshakes.

kopf's requests (its lists, watches and patches) go through aiohttp's pool, not this one, and kopf drops nothing on a
failure. aiohttp closes a connection whose answer was not read to its end (a failed request, a watch kopf gave up
for silence: deviceplane/operator/kopf_network.py) and does not reuse one idle for over 15 s (its connector's
keepalive_timeout, kept by kopf): a connection that died silently while idle can cost one of kopf's requests its
timeout (60 s; then kopf's own retry) only if it is reused within 15 s of its last answer.
"""

from __future__ import annotations

import http.client
from types import TracebackType

import urllib3
from kubernetes.client.exceptions import ApiException

# What a request, reading its answer's body, or reading a watch's stream raises when the network fails: urllib3's
# errors (ProtocolError "Connection broken" or "Response ended prematurely", ReadTimeoutError, SSLError, ...) and
# what it lets through of http.client's and the socket's.
NETWORK_ERRORS: tuple[type[Exception], ...] = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def failed_on_the_network(err: BaseException) -> bool:
    """Whether `err`, or the exception it was raised from, is a failure of the network rather than an answer."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ApiException) and current.status:
            return False  # an answer arrived
        if isinstance(current, NETWORK_ERRORS):
            return True
        seen.add(id(current))
        current = _raised_from(current)
    return False


def _raised_from(err: BaseException) -> BaseException | None:
    """The exception `err` was raised from, as its traceback would show it (`raise ... from None`: none)."""
    if err.__cause__ is not None:
        return err.__cause__
    return None if err.__suppress_context__ else err.__context__


class PoolDrop:
    """`with pool_drop:` around a request and the reading of its answer: the pool is dropped if it fails on the
    network (`failed_on_the_network`); the exception goes on as it was."""

    def __init__(self, pool: urllib3.PoolManager) -> None:
        self._pool = pool

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # Exception, not BaseException: a generator closed while it reads a watch (GeneratorExit) or a cancelled
        # task is no failure of the network, whatever was being handled around it.
        if isinstance(err, Exception) and failed_on_the_network(err):
            self._pool.clear()
