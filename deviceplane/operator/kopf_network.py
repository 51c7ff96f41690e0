"""kopf's own requests (its lists and watches of configs, nodes, DaemonSets, pods and ConfigMaps): timeouts so that
a dead connection to the API server is noticed and replaced within a bounded time, and its per-attempt error lines
summed up so that an outage is said once, not flooded.

Before (kopf's defaults, our watches ended by the API server after 300 s): no connect timeout (an unanswered TLS
handshake waited for the 300 s request timeout), a silent watch noticed after 70 s, 8 retries per request, each
logged at error level. Against an API server that stopped answering (open and new connections alike) the operator
said nothing, and once it answered again a watch stuck in a connection made during the outage took up to 70 s more
to come back (docs/operator.md, Failures; tests/e2e/test_operator_api_outage.py).
"""

from __future__ import annotations

import logging
import threading
import time

import kopf

CONNECT_TIMEOUT = 10.0  # TCP and TLS handshake, lists and watches
REQUEST_TIMEOUT = 60.0  # a whole list (the largest: every node, unchunked) or other non-watch request
# The API server ends each watch after this long, sending a bookmark 2 s before: a healthy watch is never silent for
# longer, and it resumes from a fresh resourceVersion (no re-list).
WATCH_SERVER_TIMEOUT = 20
WATCH_INACTIVITY_TIMEOUT = 30.0  # a watch silent this long is dead: kopf drops it and watches again
WATCH_CLIENT_TIMEOUT = 40.0  # a watch request's whole life, whatever arrives (a bound behind the two above)
ERROR_BACKOFFS = (1.0, 2.0, 4.0, 8.0)  # between kopf's attempts of one request, then it gives up and starts over
FAILURE_LINE_INTERVAL = 60.0  # at most one of kopf's request failure lines per this many seconds

# The logger kopf's lists and watches log their request failures to (kopf._cogs.clients.watching passes its own).
KOPF_WATCHING_LOGGER = "kopf._cogs.clients.watching"


def configure(settings: kopf.OperatorSettings) -> None:
    settings.networking.connect_timeout = CONNECT_TIMEOUT
    settings.networking.request_timeout = REQUEST_TIMEOUT
    settings.networking.error_backoffs = ERROR_BACKOFFS
    settings.watching.connect_timeout = CONNECT_TIMEOUT
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    settings.watching.inactivity_timeout = WATCH_INACTIVITY_TIMEOUT


class RequestFailureLines(logging.Filter):
    """Lets through at most one of kopf's 'Request attempt ... failed' lines per `interval`, saying how many it held
    back since the last: an outage is logged when it starts and once a minute while it lasts. kopf logs each failed
    attempt of each list and watch at error level, ~6 lines a minute per watched resource (5 here) at these
    timeouts."""

    def __init__(self, interval: float = FAILURE_LINE_INTERVAL) -> None:
        super().__init__()
        self.interval = interval
        self._lock = threading.Lock()
        self._last_shown: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not (message.startswith("Request attempt") and " failed" in message):
            return True
        now = time.monotonic()
        with self._lock:
            if self._last_shown is not None and now - self._last_shown < self.interval:
                self._held += 1
                return False
            held, self._held, self._last_shown = self._held, 0, now
        note = f"{held} more failed attempts of kopf's requests since the last such line" if held else "kopf retries"
        record.msg, record.args = (
            f"{message} ({note}; at most one such line per {self.interval:.0f} s)",
            None,
        )
        return True


def quiet_request_failures() -> None:
    """Install the filter on kopf's watching logger (once, at the operator's start)."""
    logging.getLogger(KOPF_WATCHING_LOGGER).addFilter(RequestFailureLines())
