"""The `pdserve` command: the composition root of the CLI.

Each subpackage that owns commands exposes ``register(subparsers)`` in its own
``cli.py``; this module only stitches them together, so a command lives next
to the code it drives.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from pdserve import cluster_cli, gateway_cmd, kv_cmd, launch, planner_cmd, sim_cmd, top_cmd, worker_cmd
from pdserve.decode import cli as decode_cli
from pdserve.engine import cli as engine_cli
from pdserve.router import cli as router_cli

# Modules that contribute subcommands, in the order `pdserve --help` lists them.
COMMAND_MODULES = (engine_cli, router_cli, decode_cli, cluster_cli, launch, top_cmd, planner_cmd, worker_cmd, kv_cmd,
                   gateway_cmd, sim_cmd)
# Commands from outside the product, declared as entry points of this group (pyproject.toml):
# `pdserve bench` is bench/'s (the product never imports bench/), and a plugin adds its own
# the same way. Each entry point is a ``register(subparsers)`` function.
PLUGIN_GROUP = "pdserve.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=(
            "pdserve: a disaggregated prefill/decode LLM serving cluster. "
            "Run `pdserve COMMAND --help` for the options of one command."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    for plugin in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        plugin.load()(subparsers)
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
