"""`python -m campaign.sim`: the simulated vLLM server (what a launch profile with `engine: sim` runs)."""

from campaign.sim.server import main

main()
