"""`deviceplane plugin sim`: the sim plugin and, when asked (`--control`), its HTTP control endpoint."""

from __future__ import annotations

import argparse

from deviceplane.plugin.sim import HELP, NAME, SimPlugin, add_arguments

__all__ = ["HELP", "NAME", "add_arguments", "main"]


async def main(args: argparse.Namespace) -> int:
    sim = SimPlugin(
        args.resource,
        args.count,
        args.numa,
        preferred=not args.no_preferred_allocation,
        pre_start=not args.no_pre_start,
        flap_rate=args.flap_rate,
        seed=args.seed,
        plugin_dir=args.plugin_dir,
        registry_dir=args.registry_dir,
    )
    if args.control is None:
        await sim.serve()
        return 0
    from deviceplane.plugin.sim_control import start_control  # aiohttp only when asked for

    runner = await start_control(sim, *args.control)
    try:
        await sim.serve()
    finally:
        await runner.cleanup()
    return 0
