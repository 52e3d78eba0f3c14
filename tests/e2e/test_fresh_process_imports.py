"""What a freshly started process imports: the server's start-up and the trainer-side package each load only what
they need (no torch in the server, none in `rollout` until a batch is built). Each test starts a Python process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.families import FAMILIES

_CLI_LOAD = """
import json, sys
from session_server.cli import load_family
family = load_family(sys.argv[1], sys.argv[2], without_torch=True)
messages = json.loads(sys.argv[3])
text = family.render(messages, None, add_generation_prompt=True)
json.dump({"torch": "torch" in sys.modules, "class": type(family.tokenizer).__qualname__, "text": text,
           "ids": family.tokenizer.encode(text, add_special_tokens=False)}, sys.stdout)
"""


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cli_loads_the_same_tokenizer_without_importing_torch(
    tokenizer_dirs: dict[str, Path], hf_tokenizers: dict[str, Any], name: str
) -> None:
    """The server's start-up (`main`) loads transformers in its tokenizer-only mode: torch is never imported, the
    tokenizer is the class AutoTokenizer picks with torch around, and it renders and tokenizes identically."""
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "ünï 中文 😀 <think> {\"a\": 1}"},
                {"role": "assistant", "content": "ok\n\n  done"},
                {"role": "user", "content": "again\t<|im_end|>"}]
    run = subprocess.run([sys.executable, "-c", _CLI_LOAD, str(tokenizer_dirs[name]), name, json.dumps(messages)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    got = json.loads(run.stdout)
    tokenizer = hf_tokenizers[name]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == {"torch": False, "class": type(tokenizer).__qualname__, "text": text,
                   "ids": tokenizer.encode(text, add_special_tokens=False)}


def test_importing_rollout_does_not_import_torch_or_openai() -> None:
    code = (
        "import sys, rollout, rollout.client, harness.launchers; "
        "assert 'torch' not in sys.modules, 'torch'; assert 'openai' not in sys.modules, 'openai'; "
        "rollout.to_torch_batch; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
