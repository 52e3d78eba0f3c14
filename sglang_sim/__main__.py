"""`python -m sglang_sim` runs the sglang-sim CLI."""

from sglang_sim.cli import main

main()
