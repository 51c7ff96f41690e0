"""Calling user hooks: sync or async, and turning their failures into a gRPC error for that call only."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn, TypeAlias

import grpc

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
        result = await run_in_daemon_thread(hook, *args)
        return await result if inspect.isawaitable(result) else result
    except Exception as exc:
        log.error("%s hook failed: %s", name, exc, exc_info=True)
        await abort(context, f"{name}: {str(exc) or type(exc).__name__}")


async def run_in_daemon_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a thread of its own that never delays the process's exit.

    Not asyncio.to_thread: asyncio.run() and the interpreter wait for the default executor's threads at exit, so a
    hook blocked for good would keep the plugin running after SIGTERM. A daemon thread is abandoned instead; the
    caller has stopped waiting for it by then (the RPC was cancelled).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def work() -> None:
        try:
            result = context.run(function, *args)
        except BaseException as exc:
            _settle_threadsafe(loop, future, None, exc)
        else:
            _settle_threadsafe(loop, future, result, None)

    threading.Thread(target=work, name=f"hook {getattr(function, '__name__', '')}", daemon=True).start()
    return await future


def _settle_threadsafe(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, exc: BaseException | None
) -> None:
    def settle() -> None:
        if future.done():  # the RPC was cancelled meanwhile
            return
        if exc is None:
            future.set_result(result)
        elif isinstance(exc, StopIteration):  # a future refuses it (TypeError): it would never settle
            future.set_exception(RuntimeError(f"hook raised {exc!r}"))
        else:
            future.set_exception(exc)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(settle)


async def abort(context: grpc.aio.ServicerContext[Any, Any], message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.UNKNOWN, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
