"""The LoRA adapters a gateway routes by (docs/lora.md, "Through the gateway"): those its decode
workers' records list (``load["lora_adapters"]``, gateway/backends.py `Backends.adapters`). A
request's ``model`` names the base (the served model's name, or none) or an adapter some
worker serves; any other name is 404 naming ``model``. /v1/models and ListModels list each
adapter with the served model as its parent."""

from __future__ import annotations

import dataclasses

from pdserve.api.adapters import AdapterCard
from pdserve.api.ingress import GenerateInput, RequestError

from .backends import Backends


def adapter_of(inp: GenerateInput, served_model: str) -> str | None:
    """The adapter a request runs under: its ``model`` when that is not the served model's
    name (None: the base). Not checked here (`base_input` is)."""
    return inp.model if inp.model and inp.model != served_model else None


def adapter_cards(backends: Backends, served_model: str) -> list[AdapterCard]:
    """Every adapter some decode worker serves, as /v1/models lists it: its parent the served
    model, its ``root`` its name (its directory is each worker's own)."""
    return [AdapterCard(name, name, served_model) for name in backends.adapters()]


def unknown_model(backends: Backends, served_model: str, model: str) -> RequestError:
    """The 404 (param ``model``) for a name that is neither the served model nor an adapter."""
    served = backends.adapters()
    more = f" and the LoRA adapters {sorted(served)}" if served else " (no decode worker serves a LoRA adapter)"
    return RequestError("not_found", f"model: the model {model!r} does not exist: no decode worker serves it; "
                        f"this gateway serves {served_model!r}{more}", "model")


def base_input(inp: GenerateInput, backends: Backends, served_model: str) -> GenerateInput:
    """``inp`` as the base model's validation takes it: a request under an adapter some worker
    serves without its ``model`` (checked here); a name no worker serves raises `unknown_model`."""
    adapter = adapter_of(inp, served_model)
    if adapter is None:
        return inp
    if adapter not in backends.adapters():
        raise unknown_model(backends, served_model, adapter)
    return dataclasses.replace(inp, model=None)
