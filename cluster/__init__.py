"""The fleet: wire protocol, engine worker processes, the SLO-tiered router and autoscaler (pure policies), their
asyncio service and launcher, and the HTTP entry point `python -m cluster.serve` (DESIGN.md §2, §5). The fleet
simulator and its experiments live in `cluster.sim`, which the runtime never imports."""
