"""`meshrl` console script: training, plots, configs, traces and workers."""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import json
import os
import signal
import sys
import threading
import typing
from pathlib import Path

# Every process a command starts (meshes, workers) gives its cores to OpenMP workers that sleep
# when idle: a host's generator and trainer processes each use all its cores and take turns
# (topology.devices.cpu_threads). Set before torch loads anywhere below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from meshrl.configs import ConfigError, RunConfig, load_config, to_toml
from meshrl.configs.keys import config_keys, models_in
from meshrl.configs.run_record import ALLOW_CHANGE, run_config, run_record_of, train_config
from meshrl.traces.claude_code import TraceFormatError, ingest_claude_code

CONFIG_FORMS = """config sources, applied left to right:
  @ FILE.toml           a TOML preset (repeatable; deep-merged)
  --section.key VALUE   a dotted override (kebab-case works too: --loss.kl-tau 0.01;
                        lists and dicts as JSON; a bare --flag means true, --no-flag false,
                        e.g. --metrics.no-tensorboard)
  PRIME-RL names        --trainer.loss.* for --loss.*, loss.type default for dppo_kl"""

EXIT_STOPPED = 3  # a trainer process or a worker host was lost; the message says how to resume
EXIT_CONFIG = 2
EXIT_BAD_INPUT = 1  # a trace file or run directory that cannot be used


def _sections() -> str:
    """The run config's sections, for `--help` (`meshrl config keys` lists every key)."""
    lines = ["config sections (meshrl config keys lists every key):"]
    for name, field in RunConfig.model_fields.items():
        if models_in(field.annotation):
            lines.append(f"  {name:<21} {field.description}")
    return "\n".join(lines)


TRAIN_FLAGS = f"""flags:
  --output-dir DIR      where the run writes (config, metrics, checkpoints, plots, final/)
  --max-steps N         optimizer steps of the run (a resume may raise it)
  --resume              continue the run in --output-dir from its newest checkpoint, with its own
                        config.toml; sources given beside it apply on top
  {ALLOW_CHANGE} let a resume change settings that alter training (recorded in
                        DIR/config_changes.jsonl); without it such a change is refused
  --overwrite           start over in an --output-dir that holds a run
  --seed N              seed of every random stream
  Ctrl-C (SIGINT) or SIGTERM once: stop after the step in flight, with a checkpoint (exit 130);
  twice: stop at once"""

EVAL_FLAGS = """flags:
  --checkpoint PATH     a run directory (its newest checkpoint), one of its checkpoints, its final/, or
                        an HF model directory; a run's own config.toml is the base config. Without it:
                        the config's model.path before any training
  --n N                 eval prompts (eval.n)
  --k K                 samples per prompt (eval.k)
  --out FILE.json       also write the metrics there"""


def _sources_parser(
    sub: argparse._SubParsersAction, name: str, help_text: str, flags: str = ""
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog="\n\n".join(part for part in (flags, CONFIG_FORMS, _sections()) if part),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sources", nargs="*", help="presets and overrides (see below)")
    return parser


def _cmd_config_show(args: argparse.Namespace) -> int:
    print(to_toml(load_config(args.sources)), end="")
    return 0


def _cmd_config_keys(args: argparse.Namespace) -> int:
    rows = [("KEY", "TYPE", "DEFAULT", "MEANING"), *((k.key, k.type, k.default, k.description) for k in config_keys())]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for key, type_name, default, description in rows:
        print(f"{key:<{widths[0]}}  {type_name:<{widths[1]}}  {default:<{widths[2]}}  {description}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from meshrl.run.preflight import preflight  # no torch: a refusal comes within a second

    config, changes = train_config(args.sources)  # a resume: the run's own config, these sources on top
    preflight(config)
    tls = config.topology.tls
    if any(address.startswith("tls://") for address in config.topology.workers):
        from meshrl.topology.worker import tls_env

        os.environ.update(tls_env(tls.cert, tls.key, tls.ca))  # Monarch reads them when it loads, just below
    from meshrl.run.controller import train  # torch and Monarch load only when training
    from meshrl.run.stopping import EXIT_INTERRUPTED, RunInterrupted, resume_hint
    from meshrl.topology.faults import RunStopped

    try:
        run = train(config, changes)
    except RunStopped as exc:
        print(f"meshrl: run stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except RunInterrupted as stopped:
        print(f"meshrl: stopped {stopped.where}; checkpoint {stopped.checkpoint}, plots in {stopped.root / 'plots'}. "
              f"Continue with: {resume_hint(stopped.root)}", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # a second stop signal (StopNow), or one before the signals were ours
        from meshrl.run.run_dir import RunDir

        latest = RunDir(config.output_dir).latest_checkpoint()
        print(f"meshrl: stopped at once; newest complete checkpoint: {latest or 'none'}. "
              f"Continue with: {resume_hint(Path(config.output_dir))}", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    print(f"run finished: {run}")
    return 0


def _eval_options(sources: list[str]) -> tuple[str | None, str | None, list[str]]:
    """`--checkpoint DIR` and `--out FILE` out of the words; `--n`/`--k` are `--eval.n`/`--eval.k`."""
    checkpoint = out = None
    rest: list[str] = []
    words = iter(sources)
    for word in words:
        name, eq, value = word.partition("=")
        if name in ("--checkpoint", "--out", "--n", "--k"):
            value = value if eq else next(words, None)
            if value is None:
                raise ConfigError(f"{name} needs a value")
            if name == "--checkpoint":
                checkpoint = value
            elif name == "--out":
                out = value
            else:
                rest += [f"--eval.{name[2:]}", value]
        else:
            rest.append(word)
    return checkpoint, out, rest


def _cmd_eval(args: argparse.Namespace) -> int:
    checkpoint, out, sources = _eval_options(args.sources)
    record = run_record_of(checkpoint) if checkpoint is not None else None
    if record is not None:  # a run's checkpoint is scored on the run's own task and settings
        print(f"config: {record}" + (" with the given sources on top" if sources else ""), flush=True)
    config = run_config(record.parent, sources) if record is not None else load_config(sources)
    from meshrl.run.evaluate import evaluate_base, evaluate_checkpoint

    try:
        if checkpoint is None:
            print(f"model: {config.model.path} as a run starts from it (no --checkpoint)", flush=True)
            result = evaluate_base(config, Path(out) if out else None)
        else:
            result = evaluate_checkpoint(config, checkpoint, Path(out) if out else None)
    except ValueError as exc:
        print(f"meshrl eval: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{result.prompts} prompts, {result.k} samples each")
    for key, value in result.metrics().items():
        print(f"{key:<20} {value:.4f}")
    return 0


def _cmd_tasks_build(args: argparse.Namespace) -> int:
    export, words, sources = None, iter(args.sources), []
    for word in words:
        name, eq, value = word.partition("=")
        if name == "--export":
            export = value if eq else next(words, None)
            if export is None:
                raise ConfigError("--export needs a value")
        else:
            sources.append(word)
    config = load_config(sources)
    from meshrl.tasks.base import make_task

    try:
        task = make_task(config.task)
    except ValueError as exc:
        print(f"meshrl tasks build: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    tasks = getattr(task, "tasks", None)
    print(f"{config.task.import_path}: {len(tasks) if tasks is not None else 'no'} built tasks")
    if export is not None:
        if not hasattr(task, "swe_instances"):
            print(f"meshrl tasks build: {config.task.import_path} has no instances to export", file=sys.stderr)
            return EXIT_BAD_INPUT
        instances = task.swe_instances()
        _write_atomically(Path(export), (json.dumps(instance) for instance in instances))
        print(f"{len(instances)} instances written to {export}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from meshrl.run.plots import plot

    try:
        paths = plot(args.run_dir)
    except ValueError as exc:
        print(f"meshrl: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


INGESTERS = {"claude-code": ingest_claude_code}


def _write_atomically(out: Path, lines: typing.Iterable[str]) -> None:
    """Write OUT.tmp, then rename it over OUT: a reader never sees a half-written file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _cmd_traces_ingest(args: argparse.Namespace) -> int:
    """Ingest every session before writing anything, so a bad line leaves no OUT behind."""
    out = Path(args.out)
    try:
        result = INGESTERS[args.format](args.sources, on_bad_line=args.on_bad_line)
        _write_atomically(out, (example.to_json() for example in result.examples))
    except (TraceFormatError, OSError) as exc:
        print(f"meshrl: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    turns = [turn for example in result.examples for turn in example.turns]
    print(
        f"files: {len(result.files)}, examples: {len(result.examples)}, turns: {len(turns)}, "
        f"error sites: {sum(turn.tool_error is not None for turn in turns)}, "
        f"skipped lines: {sum(result.skipped_lines.values())}, sessions without turns: {len(result.empty)}"
    )
    for path, skipped in result.skipped_lines.items():
        if skipped:
            print(f"  skipped lines in {path}: {skipped}")
    print(f"written to {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from meshrl.run.export import export_run

    try:
        out = export_run(Path(args.run_dir), Path(args.out), args.step)
    except (ValueError, OSError) as exc:
        print(f"meshrl export: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported to {out}")
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from meshrl.topology.worker import serve

    try:
        serve(
            args.address, cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, allow_remote_tcp=args.allow_remote_tcp
        )
    except ValueError as exc:
        print(f"meshrl worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def _cmd_lighthouse(args: argparse.Namespace) -> int:
    from meshrl.run.preflight import check_port_free

    check_port_free("--bind", args.bind)
    from meshrl.trainer.islands import serve_lighthouse

    lighthouse = serve_lighthouse(args.bind, args.min_islands, args.join_timeout_ms, args.heartbeat_timeout_ms)
    print(
        f"lighthouse: {lighthouse.address()}  (islands: --trainer.diloco.lighthouse {lighthouse.address()})", flush=True
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    lighthouse.shutdown()
    return 0


def _cmd_keys_generate(args: argparse.Namespace) -> int:
    from meshrl.ingress.keys import generate_keys

    try:
        public, secret = generate_keys(args.dir, args.name)
    except ValueError as exc:
        print(f"meshrl keys: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"public key: {public}  (share it: the controller's with workers, a worker's into ingress.authorized_keys)")
    print(f"secret key: {secret}  (keep it on this machine only)")
    return 0


def _cmd_rollout_worker(args: argparse.Namespace) -> int:
    import threading

    from meshrl.ingress.client import IngressError, RolloutClient
    from meshrl.ingress.worker import RolloutWorker

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack to the log
    try:
        client = RolloutClient(args.connect, args.server_key, args.key, timeout_s=args.timeout_s, stop=stop)
        worker = RolloutWorker(
            client, max_groups=args.max_groups, max_episodes=args.max_episodes, max_tokens=args.max_tokens,
            backend=args.backend,
        )  # fmt: skip
        stats = worker.run(stop)
    except (IngressError, ValueError) as exc:  # a refused key, a bad key file
        print(f"meshrl rollout-worker: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"rollout-worker stopped: leased {stats.leased} groups, verdicts {dict(stats.verdicts)}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshrl", description="RL post-training for agentic LLMs on Monarch actor meshes."
    )
    parser.add_argument("--version", action="version", version=f"meshrl {importlib.metadata.version('meshrl')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = _sources_parser(sub, "train", "train a policy with the resolved run config", TRAIN_FLAGS)
    train.set_defaults(func=_cmd_train)

    eval_help = (
        "evaluate a saved policy on the task's eval prompts, greedy and sampled: mean reward, pass@1, pass@k "
        "(--checkpoint RUN|CHECKPOINT|MODEL_DIR, --n N prompts, --k K samples, --out FILE.json)"
    )
    evaluate = _sources_parser(sub, "eval", eval_help, EVAL_FLAGS)
    evaluate.set_defaults(func=_cmd_eval)

    plot = sub.add_parser("plot", help="draw reward, loss and throughput curves of a run into DIR/plots")
    plot.add_argument("run_dir", metavar="DIR", help="a run's output directory (holds metrics.jsonl)")
    plot.set_defaults(func=_cmd_plot)

    worker_help = "run a Monarch worker on this host for a controller to attach to (topology.workers)"
    export_help = "write a run's model as an HF model directory (model.dtype, tokenizer, chat template)"
    export = sub.add_parser("export", help=export_help, description=export_help)
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    export.add_argument("out", metavar="OUT", help="the model directory to write (replaced if present)")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    export.set_defaults(func=_cmd_export)

    worker = sub.add_parser("worker", help=worker_help, description=worker_help)
    worker.add_argument("--address", required=True, help="tcp://HOST:PORT or tls://HOST:PORT to listen on")
    worker.add_argument("--tls-cert", help="PEM certificate of this worker (tls://)")
    worker.add_argument("--tls-key", help="PEM private key of that certificate (tls://)")
    worker.add_argument("--tls-ca", help="PEM CA certificate: only peers it signed may connect (tls://)")
    worker.add_argument(
        "--allow-remote-tcp",
        action="store_true",
        help="let plain tcp bind a non-loopback address (no encryption, no authentication: trusted networks only)",
    )
    worker.set_defaults(func=_cmd_worker)

    lighthouse_help = "torchft's lighthouse: membership and quorums of DiLoCo islands (trainer.diloco)"
    lighthouse = sub.add_parser("lighthouse", help=lighthouse_help, description=lighthouse_help)
    lighthouse.add_argument("--bind", default="[::]:29510", help="address to listen on (default [::]:29510)")
    lighthouse.add_argument(
        "--min-islands", type=int, default=1, help="fewest islands a quorum forms with (default 1: survivors go on)"
    )
    lighthouse.add_argument(
        "--join-timeout-ms", type=int, default=60_000, help="how long a quorum waits for islands still joining"
    )
    lighthouse.add_argument(
        "--heartbeat-timeout-ms", type=int, default=5_000, help="silence after which an island is counted gone"
    )
    lighthouse.set_defaults(func=_cmd_lighthouse)

    keys_help = "CURVE key pairs for the ingress (controller and rollout workers)"
    keys_parser = sub.add_parser("keys", help=keys_help, description=keys_help)
    keys_sub = keys_parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate = keys_sub.add_parser("generate", help="write NAME.key (public) and NAME.key_secret into DIR")
    generate.add_argument("dir", metavar="DIR", help="folder to write the key pair into")
    generate.add_argument("--name", required=True, help="file name of the pair (e.g. controller, worker-a)")
    generate.set_defaults(func=_cmd_keys_generate)

    rollout_help = "generate rollouts for a controller's ingress from outside its mesh (no Monarch, no shared FS)"
    rollout = sub.add_parser("rollout-worker", help=rollout_help, description=rollout_help)
    rollout.add_argument("--connect", required=True, help="the controller's ingress, tcp://HOST:PORT")
    rollout.add_argument("--server-key", required=True, help="the controller's public key file (NAME.key)")
    rollout.add_argument("--key", required=True, help="this worker's secret key file (NAME.key_secret)")
    rollout.add_argument("--max-groups", type=int, default=2, help="groups leased at once (default 2)")
    rollout.add_argument("--max-episodes", type=int, default=16, help="episodes run concurrently (default 16)")
    rollout.add_argument("--max-tokens", type=int, default=65536, help="KV tokens held at once (default 65536)")
    rollout.add_argument(
        "--backend", choices=("auto", "hf", "vllm"), default="auto",
        help="inference engine: vllm (its GPU build on a GPU, its CPU build otherwise), hf, or auto (default: vllm "
        "on a GPU where it is installed, else hf)",
    )  # fmt: skip
    rollout.add_argument("--timeout-s", type=float, default=30.0, help="seconds to wait for each reply before retrying")
    rollout.set_defaults(func=_cmd_rollout_worker)

    config = sub.add_parser("config", help="inspect run configs", description="inspect run configs")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = _sources_parser(config_sub, "show", "print the resolved config as TOML")
    show.set_defaults(func=_cmd_config_show)
    keys = config_sub.add_parser("keys", help="list every config key with its type, default and meaning")
    keys.set_defaults(func=_cmd_config_keys)

    tasks_help = "build the config's task (repository tasks: into their cache) and export its instances"
    tasks = sub.add_parser("tasks", help=tasks_help, description=tasks_help)
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    build_help = "build the task of the resolved config (--export FILE.jsonl: its tasks as SWE-bench-style instances)"
    build = _sources_parser(
        tasks_sub, "build", build_help, "flags:\n  --export FILE.jsonl   write the tasks as SWE-bench-style instances"
    )
    build.set_defaults(func=_cmd_tasks_build)

    traces_help = "turn agent sessions into trace examples"
    traces = sub.add_parser("traces", help=traces_help, description=traces_help)
    traces_sub = traces.add_subparsers(dest="traces_command", required=True, metavar="ACTION")
    ingest = traces_sub.add_parser(
        "ingest",
        help="read session files into a trace-example JSONL file",
        description="read session files into a trace-example JSONL file (one TraceExample per session)",
    )
    ingest.add_argument("sources", nargs="+", metavar="SRC", help="session files, or folders (all *.jsonl under them)")
    ingest.add_argument("--format", required=True, choices=sorted(INGESTERS), help="session format")
    ingest.add_argument("--out", required=True, metavar="OUT.jsonl", help="where to write the examples")
    ingest.add_argument(
        "--on-bad-line",
        choices=["error", "skip"],
        default="error",
        help="a malformed line stops with an error naming file and line (default), or is skipped and counted",
    )
    ingest.set_defaults(func=_cmd_traces_ingest)
    return parser


# Commands whose trailing words are config sources. Their order matters and they look
# like unknown options to argparse, so they are split off before parsing.
SOURCE_COMMANDS = (("train",), ("eval",), ("config", "show"), ("tasks", "build"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    for command in SOURCE_COMMANDS:
        if tuple(argv[: len(command)]) == command:
            head, sources = argv[: len(command)], argv[len(command) :]
            if "-h" in sources or "--help" in sources:
                parser.parse_args([*head, "--help"])
            args = parser.parse_args(head)
            args.sources = sources
            return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "config":  # `meshrl config keys | head` ends quietly; never for training's sockets
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"meshrl: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
