"""The `pdserve` command: the composition root of the CLI.

Each subpackage that owns commands exposes ``register(subparsers)`` in its own
``cli.py``; this module only stitches them together, so a command lives next
to the code it drives.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The planner's autoscale policy is a kind of policy file the router's loader reads once it is
# registered: `pdserve policy check` (router/cli.py) validates autoscale files through it.
import pdserve.cluster.planner.policy  # noqa: F401

# Modules that contribute subcommands, in the order `pdserve --help` lists them.
COMMAND_MODULES = (
    "pdserve.engine.cli",
    "pdserve.router.cli",
    "pdserve.decode.cli",
    "pdserve.cluster_cli",
    "pdserve.launch",
    "pdserve.planner_cmd",
    "pdserve.worker_cmd",
    "pdserve.kv_cmd",
    "pdserve.gateway_cmd",
    "pdserve.sim_cmd",
    "pdserve.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=(
            "pdserve: a disaggregated prefill/decode LLM serving cluster. "
            "Run `pdserve COMMAND --help` for the options of one command."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        # User errors (bad flag values, missing files, invalid configs) end in
        # one clear line, not a traceback.
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
