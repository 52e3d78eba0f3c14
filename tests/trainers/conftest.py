"""The trainer-adapter tier (`make test-trainers`, its own venv .venv-trainers with the trainers' released packages):
real samples from a real session server in front of sglang-sim (routed experts on: 2 layers x 2 experts per token;
a LoRA adapter `a1` loaded, which the LoRA episode's session is pinned to), fed through each adapter into the
trainer's own types.

Collected only when TEST_TRAINERS=1 (the make target sets it): the project's venv has no trainer installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import trainer_agents
from sample_checks import LORA, Episodes, run_episode
from trainer_agents import LAYERS, TOP_K

from support.stack import Stack, StackFactory

if os.environ.get("TEST_TRAINERS") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    import skyrl_seam

    skyrl_seam.load()


@pytest.fixture(scope="session")
def trainer_stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="qwen3",
                       sim_args=["--routed-experts-layers", str(LAYERS), "--routed-experts-top-k", str(TOP_K),
                                 "--enable-lora", "--lora-paths", f"{LORA}=/adapters/{LORA}",
                                 "--max-loaded-loras", "2", "--max-loras-per-batch", "2"],
                       servers={"server": ["--return-routed-experts"]}) as stack:
        trainer_agents.ENGINE["url"] = stack.engine
        yield stack


@pytest.fixture(scope="session")
def episodes(trainer_stack: Stack) -> Episodes:
    tool = run_episode(trainer_stack, trainer_agents.tool_agent, prompt="fix it")
    compacted = run_episode(trainer_stack, trainer_agents.compacting_agent)
    lora = run_episode(trainer_stack, trainer_agents.tool_agent, prompt="fix it", metadata={"lora_adapter": LORA})
    assert len(tool.samples) == 1 and len(compacted.samples) == 2 and len(lora.samples) == 1
    assert lora.samples[0].metadata["adapters"] == [[LORA, "0"]] * 3  # every turn on the adapter's revision 0
    return Episodes(trainer_stack, tool, compacted, lora)
