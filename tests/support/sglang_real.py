"""Import pieces of the released SGLang 0.5.23 (installed with --no-deps) as a test oracle.

SGLang imports many heavy modules it never calls on the paths we use (psutil, zmq, triton, CUDA helpers, ...).
Instead of installing them, each missing module is replaced by a permissive fake in `sys.modules` while importing:
any attribute of a fake is a fake class that can be called, subclassed, used as a decorator or indexed. The fakes
are only ever imported, never exercised: the oracle tests call SGLang's own request classes and checks, which are
pure Python over pydantic/msgspec/dataclasses. A module that exists but fails to import for another reason still
fails loudly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _FakeMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _fake_class(f"{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


def _fake_class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return self

    def __getattr__(self: Any, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _fake_class(attr)()

    def __get_pydantic_core_schema__(cls: Any, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()  # a field typed with a faked class (e.g. ImageData) accepts what it gets

    return _FakeMeta(name.rsplit(".", 1)[-1], (), {
        "__init__": __init__, "__call__": __call__, "__getattr__": __getattr__, "__bool__": lambda self: False,
        "__get_pydantic_core_schema__": classmethod(__get_pydantic_core_schema__)})


class _FakeModule(types.ModuleType):
    """A package (its `__path__` is set empty on creation), so fake submodules can be imported from it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _fake_class(f"{self.__name__}.{name}")


def _imported_by_sglang() -> bool:
    """Whether the import statement being executed is in SGLang's own code (or a module it fakes)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("importlib") or name == __name__):
            return name.split(".")[0] == "sglang"
        frame = frame.f_back
    return False


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: whatever no real finder provides becomes a fake (only while the oracle imports)."""

    def __init__(self) -> None:
        self.faked: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".")[0]
        if top == "sglang" or not (isinstance(sys.modules.get(top), _FakeModule) or _imported_by_sglang()):
            return None  # SGLang itself is real, and other packages keep their own ImportError fallbacks
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        self.faked.append(spec.name)
        module = _FakeModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for attr, value in _CALLED_AT_IMPORT.get(module.__name__, {}).items():
            setattr(module, attr, value)


# The few fake functions SGLang calls while importing (module-level constants), with results of the right type.
_CALLED_AT_IMPORT: dict[str, dict[str, Any]] = {
    "dill": {"dumps": lambda obj, *a, **k: b"", "loads": lambda data, *a, **k: None},  # custom_logit_processor.py
}


FAKED: list[str] = []


def import_sglang(name: str) -> types.ModuleType:
    """Import `sglang....` with fakes for the third-party modules that are not installed."""
    finder = _FakeFinder()
    sys.meta_path.append(finder)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        FAKED.extend(finder.faked)


# SGLang modules that pull in the model stack (CUDA kernels, torch.compile, model configs) but of which the request
# schema only imports names for type hints and isinstance checks on paths we never take.
HEAVY_SGLANG_MODULES = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.multimodal.mm_utils",
    "sglang.srt.beam_search.types",
    "sglang.srt.managers.embed_types",
    "sglang.srt.managers.kv_hints",
    "sglang.srt.sampling.sampling_mask",
)


def sglang_root() -> str:
    """The installed sglang package directory (found without importing it)."""
    module = sys.modules.get("sglang")
    if module is not None and getattr(module, "__path__", None):
        return str(next(iter(module.__path__)))
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang==0.5.23 (--no-deps) is a test dependency"
    return str(next(iter(spec.submodule_search_locations)))


def import_sglang_schema(name: str) -> types.ModuleType:
    """Import one of SGLang's schema modules (io_struct, sampling_params) without SGLang's package __init__ (which
    loads the language frontend and patches transformers) and with the heavy modules above faked."""
    root = sglang_root()
    return _import_schema(name, root)


def _import_schema(name: str, root: str) -> types.ModuleType:
    for pkg, path in (("sglang", root), ("sglang.srt", f"{root}/srt"), ("sglang.srt.utils", f"{root}/srt/utils")):
        if pkg not in sys.modules:
            module = _FakeModule(pkg)
            module.__path__ = [path]
            # A real spec, so importlib.util.find_spec("sglang") elsewhere in the test session still finds it.
            module.__spec__ = importlib.machinery.ModuleSpec(pkg, None, origin=f"{path}/__init__.py",
                                                             is_package=True)
            module.__spec__.submodule_search_locations = [path]
            sys.modules[pkg] = module
    for heavy in HEAVY_SGLANG_MODULES:
        if heavy not in sys.modules:
            module = _FakeModule(heavy)
            module.__path__ = []
            sys.modules[heavy] = module
    return import_sglang(name)
