"""Import the NIXL Python API from whichever NIXL wheel is installed.

The `nixl` meta package drags both CUDA 12 and 13 builds, so pdserve depends on
`nixl-cu12` and imports `nixl_cu12._api` first, then `nixl._api` and `nixl_cu13._api`.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

from pdserve.kvtransfer.nixl.errors import NixlUnavailableError

# Tried in order; the first that imports wins.
NIXL_API_MODULES = ("nixl_cu12._api", "nixl._api", "nixl_cu13._api")

# UCX settings for single-host tests and laptops: without `^ib` a process can
# segfault at exit where RDMA libraries are installed but unused; `lo` keeps
# TCP on loopback. Must be in the environment before the first agent exists.
LOOPBACK_UCX_ENV: Mapping[str, str] = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


@dataclass(frozen=True)
class NixlApi:
    """The pieces of the NIXL Python API that pdserve uses."""

    module_name: str
    agent_cls: type
    config_cls: type
    errors: tuple[type[BaseException], ...]  # every exception type the bindings raise


@functools.cache
def load_nixl() -> NixlApi:
    """Return the NIXL API, trying the cu12 build first.

    Raises NixlUnavailableError listing what was tried.
    """
    failures = []
    for name in NIXL_API_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        return _wrap(name, module)
    raise NixlUnavailableError(
        "no NIXL Python API could be imported; install `nixl-cu12` (tried: "
        + "; ".join(failures)
        + ")"
    )


def _wrap(name: str, module: ModuleType) -> NixlApi:
    bindings = module.nixlBind
    errors = tuple(
        obj
        for attr, obj in vars(bindings).items()
        if attr.startswith("nixl") and attr.endswith("Error") and isinstance(obj, type)
    )
    return NixlApi(
        module_name=name,
        agent_cls=module.nixl_agent,
        config_cls=module.nixl_agent_config,
        errors=errors,
    )


def apply_ucx_env(env: Mapping[str, str] | None) -> None:
    """Put UCX settings into this process's environment (UCX reads them when an agent starts);
    an empty value removes the variable (an inherited UCX_MODULES=^ib, say)."""
    for key, value in (env or {}).items():
        if value == "":
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
