"""LoRA adapters as SGLang 0.5.23 serves them (`--enable-lora`), emulated (issue 40; measured on the real engine, see
docs/lora.md):

- `--lora-paths NAME=DIR ...` loads adapters at start; `POST /load_lora_adapter {"lora_name", "lora_path"}` loads one
  at run time (a name already loaded is a 400 `Failed to load LoRA adapter NAME because it is already loaded`); at
  `--max-loaded-loras` a load is not refused: the least recently used adapter is evicted (and reloaded when a request
  names it again); `POST /unload_lora_adapter {"lora_name"}` unloads one (200; a name not loaded is a 400);
- a request's `lora_path` names a loaded adapter; a name never loaded is a 400 `Got LoRA adapter that has never been
  loaded: NAME` (with every name ever loaded), and -- 0.5.23's reload-on-reference -- a name that was unloaded is
  silently loaded again from the path it had;
- an adapter changes the outputs: a request's reply is a function of the adapter's files (the same files under two
  names give the same reply), and its radix-cache entries are its own (by the adapter's load, as SGLang keys them by
  `lora_id`: two names never share a prefix, even for the same files; the base model's entries stay apart too);
- `/v1/models` lists every loaded adapter as a model whose `parent` is the base model.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field


class LoraRefusal(ValueError):
    """What SGLang answers with a 400 (the message is SGLang's)."""


class UnloadRefusal(LoraRefusal):
    """An unload SGLang refuses: its 400 says `loaded_adapters: null`."""


@dataclass
class LoraAdapters:
    """The adapters the sim holds (`enabled`: the engine runs with --enable-lora)."""

    enabled: bool = False
    max_loaded: int | None = None  # --max-loaded-loras
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path
    seen: dict[str, str] = field(default_factory=dict)  # every name ever loaded -> its path (0.5.23's lora_ref_cache)
    ids: dict[str, int] = field(default_factory=dict)  # name -> the id of its current load (a new one per load)
    recency: dict[str, None] = field(default_factory=dict)  # the loaded names, least recently used first
    reloads: int = 0  # implicit reloads of an unloaded adapter a request named
    _next_id: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def load(self, name: str, path: str) -> None:
        if not self.enabled:
            raise LoraRefusal("LoRA is not enabled. Please set `--enable-lora` to True.")
        if name in self.loaded:
            raise LoraRefusal(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            evicted = next(iter(self.recency))
            del self.loaded[evicted]
            del self.recency[evicted]
            self.ids.pop(evicted, None)
        self.loaded[name] = path
        self.recency[name] = None
        self.seen[name] = path
        self.ids[name] = next(self._next_id)

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            loaded = list(self.recency)  # SGLang names them least recently used first
            raise UnloadRefusal(f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({loaded!r})")
        del self.loaded[name]
        del self.recency[name]
        self.ids.pop(name, None)

    def resolve(self, name: str) -> tuple[str, int]:
        """A request's `lora_path`: (the adapter's path, its load id); reloads an unloaded one as 0.5.23 does."""
        if not self.enabled:
            raise LoraRefusal("LoRA is not enabled. Please set `--enable-lora` to True.")
        if name not in self.loaded:
            if name not in self.seen:
                raise LoraRefusal(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: "
                                  f"{dict.fromkeys(self.seen).keys()!r}.")
            self.reloads += 1
            self.load(name, self.seen[name])
        self.recency[name] = self.recency.pop(name)  # the most recently used now
        return self.loaded[name], self.ids[name]

    def seed(self, engine_seed: int, path: str) -> int:
        """The reply seed of a request under the adapter at `path` (the same files, the same replies)."""
        digest = hashlib.blake2b(f"{engine_seed}|lora|{path}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % 2**63

    def described(self) -> dict[str, str]:
        """`loaded_adapters` of a load or unload answer."""
        return dict(self.loaded)


def parse_lora_paths(values: list[str] | None) -> dict[str, str]:
    """`--lora-paths NAME=DIR ...` (a bare DIR is named by itself, as SGLang does)."""
    out = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        out[name if sep else value] = path if sep else value
    return out
