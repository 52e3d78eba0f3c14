"""Pure trajectory core: model families, TITO prompt building, linear trajectories, engine-output validation, samples.

No I/O and no asyncio here: everything is a function of its inputs, so it is tested with hypothesis directly.
"""
