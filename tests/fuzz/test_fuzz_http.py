"""Fuzzing the HTTP API's query strings: /api/v1/devices (limit, resource, anything else) and /api/v1/pods. Every
answer is 200 with JSON that obeys the query, or 400 with a message; never a 500; the agent stays live."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import RESOURCE, assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, TestPlugin

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
        # aiohttp refuses a request line over 8190 bytes itself; otherwise only a bad limit is refused
        assert len(query) > 8000 or (path == "/api/v1/devices" and any(k == "limit" for k, _ in params)), body
        assert_live(fuzz_agent)
        return
    payload = json.loads(body)
    if path == "/api/v1/devices":
        first = {k: v for k, v in reversed(params)}  # aiohttp's query.get: the first value of a key
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
