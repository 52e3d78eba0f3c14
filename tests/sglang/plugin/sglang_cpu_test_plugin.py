"""Test-only SGLang plugin: released SGLang 0.5.23 serves a tiny model on a plain CPU, unmodified.

SGLang loads every `sglang.srt.plugins` entry point in each of its processes (launcher, tokenizer manager, scheduler,
detokenizer) before it builds a model. This directory is put on the engine's PYTHONPATH only (its
`*.dist-info/entry_points.txt` is what `importlib.metadata` finds), so no venv is changed. With `--device cpu` and
`SGLANG_USE_CPU_ENGINE` unset (the official CPU engine needs a CPU build of `sgl_kernel` that PyPI does not have),
SGLang takes its pure-PyTorch paths, except at two GPU-only spots fixed here:

- `RotaryEmbedding.__init__` imports `vllm._custom_ops.rotary_embedding` on a platform that is neither CUDA, ROCm nor
  SGLang's CPU engine. The CPU forward pass never calls it (`forward_native`), but the import must succeed: this
  provides that module with a correct pure-torch `rotary_embedding` (vLLM's in-place signature), so that a path that
  did call it would still compute the right thing.
- `--enable-return-routed-experts` allocates its host buffer with `cudaHostRegister` (pinned memory through
  `torch.cuda.cudart()`): the `cpu` entry of `ALLOC_MEMORY_FUNCS` becomes a plain allocation.
- `--enable-lora` pins host memory (`srt/lora/layers.py`, `srt/lora/backend/*.py`: `torch.tensor(..., pin_memory=True)`
  and `Tensor.pin_memory()`), which a CPU-only torch refuses ("Found no NVIDIA driver", SGLang #31894): where no
  accelerator is available, pinning is a no-op (issue 40). Nothing else changes: any pinning on such a machine
  raised before.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def rotary_embedding(
    positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any, is_neox: bool
) -> None:
    """vLLM's `_custom_ops.rotary_embedding`, in place: rotate the first `rotary_dim` features of every head of
    `query` and `key` ([tokens, heads * head_size]) by the angles of `cos_sin_cache[positions]` ([cos | sin])."""
    import torch

    cos_sin = cos_sin_cache.index_select(0, positions.flatten().long())
    cos, sin = cos_sin.chunk(2, dim=-1)
    rotary_dim = cos_sin.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(positions.numel(), -1, head_size)
        rot = heads[..., :rotary_dim]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1 = x1 * cos.to(x.dtype) - x2 * sin.to(x.dtype)
        o2 = x2 * cos.to(x.dtype) + x1 * sin.to(x.dtype)
        rotated = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        rot.copy_(rotated)


def _plain_host_alloc(
    dims: tuple[int, ...], dtype: Any, device: str, pin_memory: bool, allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> Any:
    """A host buffer in ordinary memory (no CUDA runtime to pin or register it with)."""
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


# The torch factories SGLang's LoRA code passes `pin_memory=` to (through the `torch` module).
PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                     "full_like", "as_tensor", "empty_strided", "randn", "rand")


def _without_pinning(factory: Any) -> Any:
    import functools

    @functools.wraps(factory)
    def unpinned(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return unpinned


def unpin_host_memory() -> None:
    """Pinned host memory is plain memory where torch has no accelerator (idempotent; a no-op with one)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    has_accelerator = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    if has_accelerator or getattr(torch, "_cpu_test_unpinned", False):
        return
    torch._cpu_test_unpinned = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.is_pinned = lambda self, *a, **k: False  # type: ignore[method-assign]
    for name in PINNING_FACTORIES:
        factory = getattr(torch, name, None)
        if factory is not None:
            setattr(torch, name, _without_pinning(factory))


def install() -> None:
    """The entry point SGLang calls in each of its processes."""
    # Only the submodule: `from vllm._custom_ops import ...` finds it in sys.modules without importing a `vllm`
    # package, so every other `import vllm...` in SGLang stays the ImportError it already handles.
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm._custom_ops", ops)
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

    ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_alloc
    unpin_host_memory()
