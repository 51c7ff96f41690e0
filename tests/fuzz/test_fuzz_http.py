"""Fuzzing the HTTP API: query strings of /api/v1/devices (limit, resource, anything else) and /api/v1/pods (every
answer is 200 with JSON that obeys the query, or 400 with a message; never a 500), and raw bytes to its port; the
agent stays live."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.conftest import RESOURCE, assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, TestPlugin
from tests.support.raw_http import exchange, responses

ODD = st.sampled_from(
    ["", "0", "1", "3", "00", "+1", "-1", "1.0", " 1", "\u00b2", "\u0661", "9" * 5000, "0x10", "1e3", RESOURCE]
)
VALUES = st.one_of(ODD, ODD, st.text(max_size=12), st.integers(-3, 10**6).map(str))
KEYS = st.one_of(st.sampled_from(["limit", "limit", "resource", "x", "limit[]", ""]), st.text(max_size=5))
PARAMS = st.lists(st.tuples(KEYS, VALUES), max_size=4)


def quoted(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"))


def get(agent: AgentProcess, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(agent.url + path, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@fuzz_settings(bounded=300, long=20_000)
@given(PARAMS, st.sampled_from(["/api/v1/devices", "/api/v1/pods"]), st.booleans())
def test_fuzz_http_query_strings(
    fuzz_agent: AgentProcess, fuzz_plugin: TestPlugin, params: list[tuple[str, str]], path: str, raw: bool
) -> None:
    # raw: every byte percent-encoded by hand, not only what urlencode would produce
    query = "&".join(f"{quoted(k)}={quoted(v)}" for k, v in params) if raw else urllib.parse.urlencode(params)
    status, body = get(fuzz_agent, f"{path}?{query}")
    assert status in (200, 400), (status, body[:300])
    if status == 400:
        assert body and b"Traceback" not in body
        # the server refuses a request head over 8 KiB itself (lean_http); otherwise only a bad limit is refused
        assert len(query) > 8000 or (path == "/api/v1/devices" and any(k == "limit" for k, _ in params)), body
        assert_live(fuzz_agent)
        return
    payload = json.loads(body)
    if path == "/api/v1/devices":
        first = {k: v for k, v in reversed(params)}  # the first value of a key counts
        limit = first.get("limit")
        resources = payload["resources"]
        if first.get("resource"):
            assert all(r["name"] == first["resource"] for r in resources)
        if limit is not None:
            assert limit.isascii() and limit.isdigit(), f"limit {limit!r} was accepted"
            for r in resources:
                assert len(r["devices"]) <= int(limit)
                assert r["devicesTruncated"] == (len(r["devices"]) < r["capacity"])
    else:
        assert isinstance(payload, list)
    assert_live(fuzz_agent)


RAW_LINES = st.builds(
    lambda method, path, version: b" ".join([method, path, version]),
    st.sampled_from([b"GET", b"GET", b"HEAD", b"POST", b"PUT", b"", b"G\x00T", b"get"]),
    st.sampled_from([b"/api/v1/devices", b"/api/v1/devices?limit=0", b"/api/v1/devices?limit=%ZZ", b"/api/v1/pods",
                     b"/metrics", b"/healthz", b"/readyz", b"/", b"*", b"/%00", b"/api/v1/devices?\xff=\xfe", b""]),
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b""]),
)  # fmt: skip
RAW_HEADERS = st.lists(
    st.sampled_from([b"Connection: close", b"Connection: keep-alive", b"Transfer-Encoding: chunked",
                     b"Content-Length: 3", b"Content-Length: -1", b"No-Colon", b" folded", b"X" * 9000]),
    max_size=2,
)  # fmt: skip
RAW_REQUESTS = st.builds(
    lambda line, headers, body, eol: line + eol + b"".join(h + eol for h in headers) + eol + body,
    RAW_LINES,
    RAW_HEADERS,
    st.sampled_from([b"", b"abc", b"\r\n"]),
    st.sampled_from([b"\r\n", b"\r\n", b"\n"]),
)


@fuzz_settings(bounded=200, long=20_000)
@given(st.lists(st.one_of(RAW_REQUESTS, RAW_REQUESTS, st.binary(max_size=100)), min_size=1, max_size=4))
def test_fuzz_http_raw_requests(fuzz_agent: AgentProcess, fuzz_plugin: TestPlugin, stream: list[bytes]) -> None:
    """Raw bytes to the API's port (serving/lean_http.py): damaged requests, pipelined mixes and garbage, in pieces.
    Every answer is complete and framed, one of 200/400/404/405/413 (never a 500), at most one per request; an
    error's body is JSON naming it; and the agent stays live."""
    answers = responses(exchange(fuzz_agent.port, b"".join(stream), [5, 40]))
    assert len(answers) <= len(stream) + 1
    # only an answer to HEAD has no body; there are at most as many as HEAD requests sent
    assert sum(not body for _, _, body in answers) <= b"".join(stream).count(b"HEAD ")
    for status, fields, body in answers:
        assert status in (200, 400, 404, 405, 413), (status, body[:200])
        event(f"answered {status}")
        if status != 200:
            assert fields[b"content-type"] == b"application/json"
            assert not body or json.loads(body)["error"]
    assert_live(fuzz_agent)
