"""Calling user hooks: sync or async, and turning their failures into a gRPC error for that call only."""

from __future__ import annotations

import asyncio
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

    Whatever the hook raises aborts this RPC with status UNKNOWN, the hook's name and the exception - the status the
    kubelet sees from a Go plugin returning an error - and is logged with its traceback; the plugin keeps serving.
    That includes SystemExit and KeyboardInterrupt (asyncio lets them through the loop and the process died, with a
    stale socket), and a CancelledError the hook raised while nobody cancelled this RPC (awaiting a task someone
    else cancelled): passed on, the call was never answered, and the kubelet's Allocate has no deadline. Only the
    RPC's own cancellation (client gone, deadline, plugin stopping) propagates.
    """
    try:
        if inspect.iscoroutinefunction(hook):
            return await hook(*args)
        result = await off_loop(hook, *args)
        return await result if inspect.isawaitable(result) else result
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        log.error("%s hook raised CancelledError, but the call was not cancelled", name, exc_info=True)
        await abort(context, f"{name}: {_describe(exc)} (the call itself was not cancelled)")
    except Exception as exc:
        log.error("%s hook failed: %s", name, exc, exc_info=True)
        await abort(context, f"{name}: {str(exc) or type(exc).__name__}")
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, GeneratorExit
        log.error("%s hook raised %s; failing only this call", name, _describe(exc), exc_info=True)
        await abort(context, f"{name}: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    # The type matters more than the message here: SystemExit(3)'s message is "3".
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def abort(context: grpc.aio.ServicerContext[Any, Any], message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.UNKNOWN, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
