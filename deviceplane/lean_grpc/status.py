"""gRPC status as the agent sees it: `RpcError`, with grpc's own `StatusCode`s and the interface of
`grpc.aio.AioRpcError` (`code()`, `details()`, `trailing_metadata()`), so callers and their messages do not depend
on which client made the call."""

from __future__ import annotations

import base64
import binascii
import re

import grpc

CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}

Metadata = tuple[tuple[str, str | bytes], ...]  # as grpc gives it to an application: "-bin" values as bytes

# What the transport says in a trailer block, not the server's metadata (grpc-status-details-bin is metadata: it is
# how a grpc server's application sends a rich status).
_TRANSPORT_FIELDS = frozenset(
    {"content-type", "te", "grpc-status", "grpc-message", "grpc-encoding", "grpc-accept-encoding", "grpc-timeout"}
)
_LEGAL_NAME = re.compile(r"[0-9a-z_.\-]+")  # gRPC's metadata key characters
_LEGAL_TEXT = re.compile(r"[\x20-\x7e]*")  # an ASCII value (printable, space included)


class RpcError(Exception):
    """A call that ended without a response: the peer's status, or what the client saw (deadline, transport)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing_metadata = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        """The server's trailing metadata (grpc-status-details-bin included); empty when the client ended the call."""
        return self._trailing_metadata

    def go_text(self) -> str:
        """The error as grpc-go's status error prints it, which is what the kubelet puts in its own messages."""
        code = "".join(part.capitalize() for part in self._code.name.split("_"))
        return f"rpc error: code = {'OK' if code == 'Ok' else code} desc = {self._details}"


class UnprocessedError(RpcError):
    """The server says it never processed the call (GOAWAY past its stream, or REFUSED_STREAM): safe to send again,
    which the channel does once, as grpc's transparent retry does."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


def trailing_metadata(trailers: tuple[tuple[str, str], ...]) -> Metadata:
    """The server's metadata in a trailer block (latin-1 text, as decoded): what grpc would hand an application, and
    could send on. "-bin" values are base64 (padding optional) and become bytes; a field grpc would refuse to send
    (a bad name, a text value that is not ASCII, a "-bin" value that is not base64) is left out."""
    metadata: list[tuple[str, str | bytes]] = []
    for name, value in trailers:
        if name.startswith(":") or name in _TRANSPORT_FIELDS or not _LEGAL_NAME.fullmatch(name):
            continue
        if name.endswith("-bin"):
            try:
                metadata.append((name, base64.b64decode(value + "=" * (-len(value) % 4), validate=True)))
            except (binascii.Error, ValueError):
                continue
        elif _LEGAL_TEXT.fullmatch(value):
            metadata.append((name, value))
    return tuple(metadata)


def status_code(value: str) -> grpc.StatusCode:
    """A `grpc-status` header's value; anything that is not a known code is UNKNOWN (as grpc-go)."""
    if value.isascii() and value.isdigit():
        return CODES.get(int(value), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN


# grpc-go's HTTP status -> gRPC code, for a response that is not gRPC at all (:status other than 200).
_HTTP_CODES = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}


def http_status_error(status: str) -> RpcError:
    code = _HTTP_CODES.get(int(status), grpc.StatusCode.UNKNOWN) if status.isdigit() else grpc.StatusCode.INTERNAL
    return RpcError(code, f"unexpected HTTP status code received from server: {status}")
