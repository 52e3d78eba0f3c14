"""Load SkyRL 0.4.0's seam modules on Python 3.11, from the released wheel's own files.

SkyRL 0.4.0 asks for Python >= 3.12, and two package `__init__`s on the way to its seam do not import on 3.11:
`skyrl.backends` registers the Tinker backend, whose pydantic models use `typing.TypedDict` (pydantic wants
`typing_extensions.TypedDict` below 3.12), and `skyrl.train.generators` imports the gym generators and their
environments. Neither defines a seam type. Both packages are registered here with their real `__path__` and without
running their `__init__`, so `skyrl.train.generators.base` (GeneratorInterface, GeneratorInput, GeneratorOutput,
TrajectoryID) and `skyrl.backends.skyrl_train.utils.routed_experts` load unchanged from the wheel.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path


def load() -> None:
    import skyrl
    import skyrl.train

    root = Path(skyrl.__path__[0])
    for parent, name, sub in ((skyrl, "skyrl.backends", "backends"),
                              (skyrl.train, "skyrl.train.generators", "train/generators")):
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(root / sub)]
        sys.modules[name] = package
        setattr(parent, name.rsplit(".", 1)[1], package)
