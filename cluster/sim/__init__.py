"""The fleet simulator (DESIGN.md §5): the live router, autoscaler and batch policies driven in virtual time, with
the workloads it runs, the goodput searches and bound it is judged by, and its calibration against live engines.

It imports the runtime; nothing of the runtime imports it.
- `simulator`: the event loop over a fleet (`Simulator`, `SimConfig`, `SimResult`)
- `instance`: one engine's step loop in virtual time (`SimInstance`, `SimRequest`)
- `workload`: traces, tier mixes, seeded workloads
- `goodput`: the fluid bound and the goodput searches
- `calibration`: the same workload on live emulated engines, to check the simulator against
"""
