"""`deviceplane plugin sim`: simulated devices for tests, demos and benchmarks.

Devices `sim-0 .. sim-N-1` sit on K NUMA nodes in contiguous blocks (like GPUs behind two sockets: with 8 devices and
2 nodes, sim-0..3 on node 0 and sim-4..7 on node 1). Health is steered at run time through the control endpoint
(`sim_control`, which `sim_app` starts beside it) or flipped at random with `--flap-rate`. Every hook call is
recorded, and faults (fail / hang) can be injected per RPC, so tests can see exactly what the kubelet or agent asked.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from deviceplane.aio import cancel_and_wait
from deviceplane.plugin.devices import MAX_MESSAGE_BYTES, DeviceListTooLarge
from deviceplane.plugin.models import Allocation, Device, DeviceSpec
from deviceplane.plugin.plugin import DevicePlugin
from deviceplane.plugin.preferred import NumaLayout, pack_on_numa
from deviceplane.plugin.sim_bounds import COUNT, FAULT_SECONDS, FAULT_TIMES, FLAP_RATE, NON_NEGATIVE, NUMA, PORT
from deviceplane.plugin.sim_layout import all_unhealthy_message_bytes, numa_layout

log = logging.getLogger("deviceplane.plugin.sim")

NAME = "sim"
HELP = "simulated devices over NUMA nodes, health steerable at run time"
RPCS = ("Allocate", "GetPreferredAllocation", "PreStartContainer")
# Recorded calls kept per RPC: a long-running sim keeps exact counts but only the latest entries (each
# GetPreferredAllocation entry carries every available ID, so keeping them all grew without bound).
CALLS_KEPT = 1000


class CallLog:
    """The RPCs the sim answered: exact counts, and the latest `kept` requests per RPC, oldest first."""

    def __init__(self, kept: int = CALLS_KEPT) -> None:
        self._entries: dict[str, deque[dict[str, Any]]] = {rpc: deque(maxlen=kept) for rpc in RPCS}
        self._counts = dict.fromkeys(RPCS, 0)

    def add(self, rpc: str, entry: dict[str, Any]) -> None:
        self._entries[rpc].append(entry)
        self._counts[rpc] += 1

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def entries(self) -> dict[str, list[dict[str, Any]]]:
        return {rpc: list(entries) for rpc, entries in self._entries.items()}

    def clear(self) -> None:
        for entries in self._entries.values():
            entries.clear()
        self._counts = dict.fromkeys(RPCS, 0)


def non_negative_float(text: str) -> float:
    """argparse type for a finite number >= 0 (the demo's --duration)."""
    return NON_NEGATIVE.parse(text)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (PORT 0 = any free port), got {text!r}")
    try:
        return host, PORT.parse(port)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}: PORT {err}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resource", default="example.com/sim", help="extended resource name [%(default)s]")
    parser.add_argument("--count", type=COUNT.parse, default=8, help="number of devices, sim-0..N-1 [%(default)s]")
    parser.add_argument("--numa", type=NUMA.parse, default=1, help="NUMA nodes; 0 = no topology [%(default)s]")
    parser.add_argument(
        "--control", type=_address, metavar="HOST:PORT", help="serve the HTTP control endpoint here (port 0: any)"
    )
    parser.add_argument(
        "--flap-rate",
        type=FLAP_RATE.parse,
        default=0.0,
        help=f"random health flips per second, up to {FLAP_RATE.high:g} [0 = off]",
    )
    parser.add_argument("--seed", type=int, help="seed for --flap-rate (default: random)")
    parser.add_argument("--no-preferred-allocation", action="store_true", help="do not offer GetPreferredAllocation")
    parser.add_argument("--no-pre-start", action="store_true", help="do not ask for PreStartContainer")


FaultMode = Literal["fail", "hang"]


class SimFault(Exception):
    """An injected failure."""


@dataclass
class Fault:
    mode: FaultMode
    message: str = "injected failure"
    seconds: float | None = None  # hang: how long (None = until the call is cancelled)
    remaining: int | None = None  # how many more calls it affects (None = until cleared)

    @classmethod
    def from_json(cls, data: Any) -> Fault:
        if not isinstance(data, dict) or data.get("mode") not in ("fail", "hang"):
            raise ValueError('expected {"mode": "fail"|"hang", "message"?, "seconds"?, "times"?}')
        seconds, times, message = data.get("seconds"), data.get("times"), data.get("message", "injected failure")
        if seconds is not None:
            seconds = FAULT_SECONDS.check(seconds)
        if times is not None:
            times = FAULT_TIMES.check(times)
        if not isinstance(message, str):
            raise ValueError(f"message must be a string, got {message!r}")
        mode: FaultMode = "fail" if data["mode"] == "fail" else "hang"
        return cls(mode, message, seconds, times)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "message": self.message, "seconds": self.seconds, "times": self.remaining}


class SimPlugin:
    def __init__(
        self,
        resource: str,
        count: int,
        numa: int,
        *,
        preferred: bool = True,
        pre_start: bool = True,
        flap_rate: float = 0.0,
        seed: int | None = None,
        plugin_dir: str | os.PathLike[str] | None = None,
        registry_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.numa_of = numa_layout(count, numa)
        # Made at the first GetPreferredAllocation, not at start: 4 ms at 1,024 devices but ~0.4 s at 100,000, which
        # would delay every start, also of sims that are never asked. The devices never move between nodes.
        self._packing: NumaLayout | None = None
        longest = all_unhealthy_message_bytes(self.numa_of)
        if longest > MAX_MESSAGE_BYTES:
            raise DeviceListTooLarge(
                f"--count {count} --numa {numa}: {count} devices make a {longest}-byte ListAndWatch message when all "
                f"are unhealthy, over the kubelet's limit of {MAX_MESSAGE_BYTES} bytes (4 MiB, gRPC's default): "
                "fewer devices"
            )
        self.health = dict.fromkeys(self.numa_of, True)
        self.calls = CallLog()
        self.faults: dict[str, Fault] = {}
        self.flap_rate = flap_rate
        self.flips = 0
        self._random = random.Random(seed)
        self.plugin = DevicePlugin(
            resource,
            self.devices(),
            allocate=self.allocate,
            get_preferred_allocation=self.get_preferred_allocation if preferred else None,
            pre_start_container=self.pre_start_container if pre_start else None,
            plugin_dir=plugin_dir,
            registry_dir=registry_dir,
        )

    def devices(self) -> list[Device]:
        return [Device(i, healthy=self.health[i], numa_nodes=self.numa_of[i]) for i in self.numa_of]

    def set_health(self, changes: Mapping[str, bool]) -> None:
        """Apply several health changes as one snapshot. KeyError for an unknown device, nothing changed then."""
        unknown = [i for i in changes if i not in self.health]
        if unknown:
            raise KeyError(f"no such device: {', '.join(unknown)}")
        self.health.update(changes)
        self.plugin.set_devices(self.devices())

    # -- hooks: record, then apply an injected fault, then answer ---------------------------------------------

    def _record(self, rpc: str, **request: Any) -> dict[str, Any]:
        entry = {"time": time.time(), **request}
        self.calls.add(rpc, entry)
        return entry

    async def _fault(self, rpc: str) -> None:
        fault = self.faults.get(rpc)
        if fault is None:
            return
        if fault.remaining is not None:
            fault.remaining -= 1
            if fault.remaining <= 0:
                del self.faults[rpc]
        if fault.mode == "fail":
            raise SimFault(fault.message)
        if fault.seconds is None:
            await asyncio.Event().wait()  # until the RPC is cancelled (client deadline or plugin shutdown)
        else:
            await asyncio.sleep(fault.seconds)

    async def allocate(self, device_ids: list[str]) -> Allocation:
        self._record("Allocate", devices_ids=device_ids)
        await self._fault("Allocate")
        return Allocation(
            envs={"SIM_DEVICES": ",".join(device_ids)},
            devices=[DeviceSpec(f"/dev/{i}", "/dev/null", "rw") for i in device_ids],
        )

    async def get_preferred_allocation(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        entry = self._record(
            "GetPreferredAllocation",
            available_deviceIDs=available,
            must_include_deviceIDs=must_include,
            allocation_size=size,
        )
        await self._fault("GetPreferredAllocation")
        if self._packing is None:
            self._packing = NumaLayout(self.numa_of)
        entry["result"] = pack_on_numa(available, must_include, size, self._packing)
        return list(entry["result"])

    async def pre_start_container(self, device_ids: list[str]) -> None:
        self._record("PreStartContainer", devices_ids=device_ids)
        await self._fault("PreStartContainer")

    # -- running ---------------------------------------------------------------------------------------------

    async def _flap(self) -> None:
        while True:
            if self.flap_rate <= 0 or not self.health:
                await asyncio.sleep(0.2)  # re-read the rate: the control endpoint may turn flapping on
                continue
            await asyncio.sleep(1 / self.flap_rate)
            device_id = self._random.choice(list(self.health))
            self.set_health({device_id: not self.health[device_id]})
            self.flips += 1

    async def serve(self) -> None:
        """Serve the plugin (and flap health, if asked) until cancelled."""
        flapper = asyncio.create_task(self._flap())
        try:
            await self.plugin.serve()
        finally:
            await cancel_and_wait([flapper])
