"""Calling user hooks: sync or async, and turning their failures into a gRPC error for that call only."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn, TypeAlias

import grpc

from deviceplane.aio import off_loop

log = logging.getLogger("deviceplane.plugin")

# allocate(device_ids) -> Allocation | None; called once per container in an AllocateRequest.
AllocateHook: TypeAlias = Callable[[list[str]], Any]
# get_preferred_allocation(available, must_include, size) -> device ids; once per container request.
PreferredAllocationHook: TypeAlias = Callable[[list[str], list[str], int], Iterable[str] | Awaitable[Iterable[str]]]
# pre_start_container(device_ids) -> None
PreStartHook: TypeAlias = Callable[[list[str]], Any]


async def call_hook(
    name: str, hook: Callable[..., Any], context: grpc.aio.ServicerContext[Any, Any], *args: Any
) -> Any:
    """Run `hook(*args)`: coroutine functions on the loop, plain functions in a daemon thread (they may block).

    An exception aborts this RPC with status UNKNOWN and the exception's message - the same status the kubelet sees
    from a Go plugin returning an error - and is logged; the plugin keeps serving.
    """
    try:
        if inspect.iscoroutinefunction(hook):
            return await hook(*args)
        result = await off_loop(hook, *args)
        return await result if inspect.isawaitable(result) else result
    except Exception as exc:
        log.error("%s hook failed: %s", name, exc, exc_info=True)
        await abort(context, f"{name}: {str(exc) or type(exc).__name__}")


async def abort(context: grpc.aio.ServicerContext[Any, Any], message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.UNKNOWN, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
