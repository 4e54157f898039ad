"""The `rlbus` command. Each subcommand imports its heavy modules lazily, so `rlbus --help` is instant.

    rlbus config show configs/quickstart.yaml trainer.lr=3e-6
    rlbus bus up --dir .rlbus/bus
"""

from __future__ import annotations

import argparse
import sys


def _load(args: argparse.Namespace):
    from schemas.config import load_config

    return load_config(args.config, args.overrides)


def cmd_config_show(args: argparse.Namespace) -> int:
    from schemas.config import to_yaml

    print(to_yaml(_load(args)), end="")
    return 0


def cmd_bus_up(args: argparse.Namespace) -> int:
    from bus.server import serve_forever

    return serve_forever(store_dir=args.dir, port=args.port, host=args.host)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus", description="Asynchronous, event-driven RL post-training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("config", help="YAML run config (e.g. configs/quickstart.yaml)")
        sp.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied in order")
        return sp

    cfg = sub.add_parser("config", help="inspect run configs")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    with_config(cfg_sub.add_parser("show", help="print the resolved config")).set_defaults(func=cmd_config_show)

    bus = sub.add_parser("bus", help="the embedded NATS JetStream server")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True, metavar="ACTION")
    up = bus_sub.add_parser("up", help="run nats-server with JetStream, file storage and generated credentials")
    up.add_argument("--dir", default=".rlbus/bus", help="store directory (JetStream files, credentials)")
    up.add_argument("--port", type=int, default=4222, help="client port (0 = pick a free one)")
    up.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    up.set_defaults(func=cmd_bus_up)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from schemas.errors import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"rlbus: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
