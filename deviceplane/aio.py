"""asyncio helpers shared by the agent and the plugin SDK."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel every task and wait until each has finished; their outcomes (errors included) are collected, not
    raised."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread of its own, awaited.

    Not `asyncio.to_thread`: asyncio.run() and the interpreter join the default executor's threads at exit, so a
    call blocked for good (a request to an unreachable API server, a plugin hook that never returns) would hold up
    the process's exit after SIGTERM. A daemon thread is left behind instead; its caller stopped waiting by then.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if error is None:
            future.set_result(result)  # type: ignore[arg-type]
        elif isinstance(error, StopIteration):  # a future refuses it (TypeError): it would never settle
            future.set_exception(RuntimeError(f"{getattr(fn, '__name__', 'call')} raised {error!r}"))
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result = context.run(fn, *args)
        except BaseException as err:
            _post(loop, settle, None, err)
        else:
            _post(loop, settle, result, None)

    threading.Thread(target=target, name=f"off-loop {getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
        loop.call_soon_threadsafe(fn, *args)
