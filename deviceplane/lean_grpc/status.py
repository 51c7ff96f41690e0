"""gRPC status as the agent sees it: `RpcError`, with grpc's own `StatusCode`s and the interface of
`grpc.aio.AioRpcError` (`code()`, `details()`), so callers and their messages do not depend on which client made
the call."""

from __future__ import annotations

import grpc

CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class RpcError(Exception):
    """A call that ended without a response: the peer's status, or what the client saw (deadline, transport)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def go_text(self) -> str:
        """The error as grpc-go's status error prints it, which is what the kubelet puts in its own messages."""
        code = "".join(part.capitalize() for part in self._code.name.split("_"))
        return f"rpc error: code = {'OK' if code == 'Ok' else code} desc = {self._details}"


class UnprocessedError(RpcError):
    """The server says it never processed the call (GOAWAY past its stream, or REFUSED_STREAM): safe to send again,
    which the channel does once, as grpc's transparent retry does."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


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
