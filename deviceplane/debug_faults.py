"""Test-only fault hooks shared by the agent and the operator, all off unless `DEVICEPLANE_DEBUG_FAULTS=1`.

A blocked event loop is a fault no real part produces on demand, so tests simulate it: `block_event_loop` sleeps on
the loop, as a blocking call or a spin in some part of the process would. The agent runs it from
`POST /debug/fault?block_loop=SECONDS` (agent/serving/debug_faults.py), the operator on SIGUSR1
(`install_block_signal`), whose kopf loop serves no route of ours.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping

DEBUG_FAULTS_ENV = "DEVICEPLANE_DEBUG_FAULTS"
SIGNAL_BLOCK_SECONDS = 3.0


def debug_faults_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DEBUG_FAULTS_ENV) == "1"


def block_event_loop(seconds: float) -> None:
    """Holds the calling thread, the event loop's here; named so a stack dump shows who held it."""
    time.sleep(seconds)


def install_block_signal(loop: asyncio.AbstractEventLoop, seconds: float = SIGNAL_BLOCK_SECONDS) -> None:
    """With DEVICEPLANE_DEBUG_FAULTS=1: SIGUSR1 blocks `loop` for `seconds`; otherwise nothing."""
    if debug_faults_enabled():
        loop.add_signal_handler(signal.SIGUSR1, block_event_loop, seconds)
