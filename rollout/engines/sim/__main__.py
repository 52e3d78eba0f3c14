"""`python -m rollout.engines.sim` runs the sglang-sim CLI."""

from rollout.engines.sim.cli import main

main()
