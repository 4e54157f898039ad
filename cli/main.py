"""The `rlbus` command. Each subcommand imports its heavy modules lazily, so `rlbus --help` is instant.

    rlbus config show configs/quickstart.yaml trainer.lr=3e-6
    rlbus bus up --dir .rlbus/bus
"""

from __future__ import annotations

import argparse
import sys


def _load(args: argparse.Namespace):
    from rlbus.schemas.config_io import load_config

    return load_config(args.config, args.overrides)


def cmd_config_show(args: argparse.Namespace) -> int:
    from rlbus.cli.validate import CONFIG_ERROR_EXIT, config_errors
    from rlbus.schemas.config_io import to_yaml

    cfg = _load(args)
    print(to_yaml(cfg), end="")
    errors = config_errors(cfg)  # what the schema cannot know: names, import paths, model directories
    for e in errors:
        print(f"rlbus: config error: {e}", file=sys.stderr)
    return CONFIG_ERROR_EXIT if errors else 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from rlbus.cli.config_doc import reference_markdown

    print(reference_markdown(), end="")
    return 0


def cmd_bus_up(args: argparse.Namespace) -> int:
    from rlbus.bus.server import Cluster, serve_forever
    from rlbus.schemas.errors import BusError

    cluster = None
    if args.cluster_port or args.routes:
        try:
            cluster = Cluster(args.cluster_name, args.cluster_port,
                              [r.strip() for r in args.routes.split(",") if r.strip()])
        except BusError as e:
            print(f"rlbus bus up: {e}", file=sys.stderr)
            return 2
    return serve_forever(store_dir=args.dir, port=args.port, host=args.host, runs=args.run, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, tls_ca=args.tls_ca, cluster=cluster, creds_store=args.creds_store)


def cmd_init_model(args: argparse.Namespace) -> int:
    from rlbus.common.model.init_model import main as init_main
    from rlbus.producers.evaluate import main as evaluate_main

    return int(init_main(args.rest, evaluate=evaluate_main) or 0)


def cmd_rollout(args: argparse.Namespace) -> int:
    from rlbus.producers.rollout_dry_run import main as rollout_main

    return int(rollout_main(args.rest) or 0)


def cmd_producer(args: argparse.Namespace) -> int:
    from rlbus.producers.service import main as producer_main

    return producer_main(_load(args), producer_id=args.id)


def cmd_evaluator(args: argparse.Namespace) -> int:
    from rlbus.producers.evaluator import main as evaluator_main

    return evaluator_main(_load(args))


def cmd_judge(args: argparse.Namespace) -> int:
    from rlbus.producers.judge_service import main as judge_main

    return judge_main(_load(args))


def cmd_tinker(args: argparse.Namespace) -> int:
    from rlbus.tinker_api.service import main as tinker_main

    return tinker_main(_load(args))


def cmd_trainer(args: argparse.Namespace) -> int:
    from rlbus.trainer.service import main as trainer_main

    return trainer_main(_load(args))


def cmd_up(args: argparse.Namespace) -> int:
    from rlbus.cli.validate import check_config

    cfg = _load(args)
    check_config(cfg)  # a config error exits 2 here, before the bus, Ray or any role starts (and restarts)
    from rlbus.cli.launcher import main as up_main

    return up_main(cfg, entry=main, ui=args.ui)


def cmd_status(args: argparse.Namespace) -> int:
    from rlbus.cli.status import main as status_main

    return status_main(_load(args))


def cmd_scale(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlbus.cli.launcher import scale_main

    return scale_main(Path(args.run_dir), args.n, wait=args.wait, timeout=args.timeout)


def cmd_plot(args: argparse.Namespace) -> int:
    from rlbus.cli.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rlbus.cli.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out))
    return 0


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
    from rlbus.cli.prompts import add_parser as add_prompts_parser

    add_prompts_parser(cfg_sub, with_config)
    cfg_sub.add_parser("reference", help="print every config key with its default and meaning (Markdown)"
                       ).set_defaults(func=cmd_config_reference)

    bus = sub.add_parser("bus", help="the embedded NATS JetStream server")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True, metavar="ACTION")
    up = bus_sub.add_parser("up", help="run nats-server with JetStream, file storage and generated credentials")
    up.add_argument("--dir", default=".rlbus/bus", help="store directory (JetStream files, credentials)")
    up.add_argument("--port", type=int, default=4222, help="client port (0 = pick a free one)")
    up.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    up.add_argument("--run", action="append", default=None, metavar="NAME",
                    help="run (config `name`) whose per-role users to create; repeat for several (default: rlbus)")
    up.add_argument("--tls-cert", default="", help="server certificate (PEM): clients must connect with TLS")
    up.add_argument("--tls-key", default="", help="the certificate's private key (PEM)")
    up.add_argument("--tls-ca", default="", help="CA (PEM) client certificates must be signed by (mutual TLS)")
    up.add_argument("--cluster-port", type=int, default=0, help="route port: join a NATS cluster (JetStream R3)")
    up.add_argument("--cluster-name", default="rlbus", help="the cluster's name (the same on every server)")
    up.add_argument("--routes", default="", help="the other servers' route addresses, host:port,host:port")
    up.add_argument("--creds-store", default="", help="directory holding creds/ (shared by a cluster's servers; "
                    "default: --dir)")
    up.set_defaults(func=cmd_bus_up)

    # init-model and rollout parse their own arguments (their modules own the flags).
    im = sub.add_parser("init-model", help="build the tiny quickstart model offline, or import a GGUF model", add_help=False)
    im.add_argument("rest", nargs=argparse.REMAINDER)
    im.set_defaults(func=cmd_init_model)
    ro = sub.add_parser("rollout", help="dry-run the agent loop on N prompts (no bus, no Ray)", add_help=False)
    ro.add_argument("rest", nargs=argparse.REMAINDER)
    ro.set_defaults(func=cmd_rollout)
    ev = sub.add_parser("events", help="inspect a run's event log (filter, decode, export, follow)", add_help=False)
    ev.add_argument("rest", nargs=argparse.REMAINDER)
    ev.set_defaults(func=cmd_events)
    rp = sub.add_parser("replay", help="replay recorded steps on CPU: bit for bit, or what-if with overrides",
                        add_help=False)
    rp.add_argument("rest", nargs=argparse.REMAINDER)
    rp.set_defaults(func=cmd_replay)
    ui = sub.add_parser("ui", help="a web inspector of a live or finished run directory (loopback, token)",
                        add_help=False)
    ui.add_argument("rest", nargs=argparse.REMAINDER)
    ui.set_defaults(func=cmd_ui)
    sc = sub.add_parser("schema", help="the wire contract: JSON Schema of every wire type, docs/wire.md",
                        add_help=False)
    sc.add_argument("rest", nargs=argparse.REMAINDER)
    sc.set_defaults(func=cmd_schema)

    pr = with_config(sub.add_parser("producer", help="run a rollout producer (any number, any time)"))
    pr.add_argument("--id", default="", help="producer id (default: <host>-<pid>)")
    pr.set_defaults(func=cmd_producer)
    ev = with_config(sub.add_parser("evaluator", help="score weight versions on held-out prompts (eval.interval)"))
    ev.set_defaults(func=cmd_evaluator)
    with_config(sub.add_parser("trainer", help="run the trainer (and the prompt feeder)")).set_defaults(func=cmd_trainer)
    with_config(sub.add_parser("judge", help="serve the judge model of a model-based reward (judge.*): batched, "
                                             "bounded, restartable")).set_defaults(func=cmd_judge)
    with_config(sub.add_parser("tinker", help="serve the Tinker API to the `tinker` SDK: LoRA training and sampling "
                                              "on model.path (docs/tinker.md)")).set_defaults(func=cmd_tinker)
    upp = with_config(sub.add_parser("up", help="all in one: bus, Ray, trainer and producers, supervised, "
                                                "with progress"))
    upp.add_argument("--ui", action="store_true", help="also serve the web inspector (rlbus ui) beside the run")
    upp.set_defaults(func=cmd_up)
    with_config(sub.add_parser("status", help="show a live run's state, read from the bus")).set_defaults(func=cmd_status)

    scl = sub.add_parser("scale", help="add or remove producers of a running `rlbus up` (no restart)")
    scl.add_argument("run_dir", help="the run directory of the `rlbus up` to scale")
    scl.add_argument("n", type=int, help="number of producers to run")
    scl.add_argument("--wait", action="store_true", help="return once exactly N run (removed ones drained)")
    scl.add_argument("--timeout", type=float, default=180.0, help="seconds --wait waits (default 180)")
    scl.set_defaults(func=cmd_scale)
    pl = sub.add_parser("plot", help="draw reward / staleness / throughput curves of a run directory")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    pl.set_defaults(func=cmd_plot)
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    ex.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N")
    ex.add_argument("out", help="output directory")
    ex.set_defaults(func=cmd_export)
    return p


def cmd_events(args: argparse.Namespace) -> int:
    from rlbus.cli.events import main as events_main

    return int(events_main(args.rest) or 0)


def cmd_replay(args: argparse.Namespace) -> int:
    from rlbus.trainer.replay import main as replay_main

    return int(replay_main(args.rest) or 0)


def cmd_ui(args: argparse.Namespace) -> int:
    from rlbus.cli.ui import main as ui_main

    return int(ui_main(args.rest) or 0)


def cmd_schema(args: argparse.Namespace) -> int:
    from rlbus.cli.schema import main as schema_main

    return int(schema_main(args.rest) or 0)


#: Subcommands whose modules own all their flags; their arguments are handed over untouched (`--help` included).
PASSTHROUGH = {"init-model": cmd_init_model, "rollout": cmd_rollout, "events": cmd_events, "replay": cmd_replay,
               "schema": cmd_schema, "ui": cmd_ui}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH:
        args = argparse.Namespace(rest=argv[1:], func=PASSTHROUGH[argv[0]])
    else:
        args = build_parser().parse_args(argv)
    from rlbus.cli.run_lock import hold_inherited
    from rlbus.cli.validate import CONFIG_ERROR_EXIT
    from rlbus.schemas.errors import ConfigError

    hold_inherited()  # a role `rlbus up` started shares its run directory's lock until it exits
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"rlbus: config error: {e}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
