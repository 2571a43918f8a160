"""The LoRA adapters a decode worker serves by name (docs/lora.md, "The API"): the request's
``model`` names one (the base model's served name, or no model: none), /v1/models and
ListModels list them, and vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
change them at run time.

`parse_lora_modules` reads the modules a worker starts with (``--lora-modules`` and the
topology's ``lora.modules``: ``name=path`` or vLLM's JSON form); `Adapters` is the registry a
`Surface` consults: each name bound to one `LoRARequest`, its integer id given here, and the
requests in flight per adapter (an adapter in use is not unloaded: 409). Pure bookkeeping; the
adapter's files are read and checked by the engine (engine/lora.py `load_adapter`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from pdserve.engine import LoRARequest

from .ingress import RequestError


@dataclass(frozen=True)
class LoRAModule:
    """One adapter a worker serves from the start: its name (the ``model`` clients send), its
    PEFT directory, and the base model it was made for (vLLM's ``base_model_name``; listed as
    its ``parent``, None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None

    def to_dict(self) -> dict:
        d = {"name": self.name, "path": self.path}
        if self.base_model_name is not None:
            d["base_model_name"] = self.base_model_name
        return d


def parse_lora_module(entry: object, where: str = "lora_modules") -> LoRAModule:
    """One entry: ``"name=path"``, vLLM's JSON text ``'{"name": ..., "path": ...,
    "base_model_name": ...}'``, or that object as a mapping (the topology). ValueError
    naming ``where`` (the flag or the topology field, with its index)."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc}); use name=path or "
                             '{"name": ..., "path": ..., "base_model_name": ...}') from None
    if isinstance(entry, str):
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{where}: {entry!r} is not name=path")
        return _checked(name.strip(), path.strip(), None, where)
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key; known: base_model_name, name, path")
        for key in ("name", "path"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ValueError(f"{where}.{key}: must be a non-empty string, got {entry.get(key)!r}")
        base = entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{where}.base_model_name: must be a string, got {base!r}")
        return _checked(entry["name"].strip(), entry["path"].strip(), base, where)
    raise ValueError(f"{where}: {entry!r} must be name=path or an object with name and path")


def _checked(name: str, path: str, base: str | None, where: str) -> LoRAModule:
    if "\x00" in name or "\x00" in path:
        raise ValueError(f"{where}: NUL in the name or path")
    return LoRAModule(name, path, base)


def parse_lora_modules(entries: list | None, where: str = "lora_modules") -> list[LoRAModule]:
    """Every entry (`parse_lora_module`); a name given twice is refused, naming its index."""
    out: list[LoRAModule] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries or ()):
        mod = parse_lora_module(entry, f"{where}[{i}]")
        if mod.name in seen:
            raise ValueError(f"{where}[{i}].name: {mod.name!r} is given twice")
        seen.add(mod.name)
        out.append(mod)
    return out


@dataclass(frozen=True)
class AdapterCard:
    """An adapter as /v1/models and ListModels describe it (vLLM's ModelCard: ``root`` is the
    adapter's path, ``parent`` the base model)."""

    id: str
    root: str
    parent: str


class Adapters:
    """The adapters served by name, with the requests in flight under each.

    ``check``: reads and checks an adapter (engine/lora.py `load_adapter`; raises its
    `LoRAError`), called by `load` before the name is served. A name once bound to a path keeps
    it while the worker runs (the engine's prefix cache and slots know adapters by name): it
    may be unloaded and loaded again from the same path, not from another."""

    def __init__(self, served_model: str, check: Callable[[LoRARequest], object]):
        self.served_model = served_model
        self._check = check
        self.served: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._bound: dict[str, LoRARequest] = {}  # every name ever served -> its request (ids kept)
        self._next_id = 1
        self.in_flight: Counter[str] = Counter()

    def __contains__(self, name: object) -> bool:
        return name in self.served

    def get(self, name: str) -> LoRARequest | None:
        return self.served.get(name)

    def cards(self) -> list[AdapterCard]:
        return [AdapterCard(n, r.lora_path, self.parents[n]) for n, r in self.served.items()]

    def load(self, name: object, path: object, base_model_name: str | None = None) -> LoRARequest:
        """Serve ``name`` from ``path`` (RequestError naming lora_name / lora_path, or the
        adapter's field, as invalid_argument)."""
        if not isinstance(name, str) or not name or "\x00" in name:
            raise RequestError("invalid_argument", "lora_name: must be a non-empty string", "lora_name")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise RequestError("invalid_argument", "lora_path: must be a non-empty string", "lora_path")
        if name == self.served_model:
            raise RequestError("invalid_argument", f"lora_name: {name!r} is the base model's name", "lora_name")
        if name in self.served:
            raise RequestError("invalid_argument", f"lora_name: the adapter {name!r} has already been loaded "
                               f"(from {self.served[name].lora_path}); unload it first", "lora_name")
        bound = self._bound.get(name)
        if bound is not None and bound.lora_path != path:
            raise RequestError("invalid_argument", f"lora_path: the name {name!r} was served from "
                               f"{bound.lora_path} on this worker; load it from there or use another name",
                               "lora_path")
        lora = bound or LoRARequest(name, self._next_id, path)
        try:
            self._check(lora)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001  (a LoRAError names its field; anything else is the path's)
            field = getattr(exc, "field", None)  # the adapter's setting or weight at fault
            what = "" if field in (None, "lora_request.lora_path") else f" [{field}]"
            raise RequestError("invalid_argument", f"lora_path: {exc}{what}", "lora_path") from None
        if bound is None:
            self._next_id += 1
            self._bound[name] = lora
        self.served[name] = lora
        self.parents[name] = base_model_name or self.served_model
        return lora

    def unload(self, name: object) -> None:
        """Stop serving ``name`` (RequestError: not_found when not served; already_exists (409)
        while requests run under it: they are not cut short, the caller retries once they end)."""
        if not isinstance(name, str) or name not in self.served:
            raise RequestError("not_found", f"lora_name: the adapter {name!r} is not loaded", "lora_name")
        if self.in_flight[name]:
            raise RequestError("already_exists", f"lora_name: {self.in_flight[name]} request(s) are running under "
                               f"the adapter {name!r}; unload it once they end", "lora_name")
        del self.served[name]
        del self.parents[name]

    def begin(self, name: str) -> None:
        self.in_flight[name] += 1

    def end(self, name: str) -> None:
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]
