"""The processes a coordinator starts: `layersplit shard` (also started by hand on another host)
and `layersplit draft`. Their command lines, and `main`, which runs one: started fresh
(`python -m layersplit.launch.cli shard ...`, which comes here), started ahead and handed its
arguments on stdin (`runtime.handover`), or forked from the zygote (`runtime.zygote`).

Nothing here imports the coordinator's side (`runtime.supervisor`, `runtime.zygote`): the
zygote imports this module.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from layersplit.ipc.shm import release_cuda_event_files

COMMANDS = ("shard", "draft")


def setup_logging(verbose: bool, prefix: str = "") -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The `shard` and `draft` commands, on a parser's subcommands (`launch.cli.build_parser`)."""
    from layersplit.runtime.config import HEARTBEAT_TIMEOUT_S

    s = sub.add_parser("shard", help="run one shard (started by hand on another host)")
    s.add_argument("--listen", required=True, help="tcp://HOST:PORT (loopback unless told)")
    s.add_argument("--model", default="default")
    s.add_argument("--layers", required=True, help="START:END")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--weight-format", default="dequantize", choices=["dequantize", "quantized"],
                   help="GGUF weights kept in their blocks, or dequantized to --dtype")
    s.add_argument("--random-seed", type=int, default=0, help="seed of random:NAME weights")
    s.add_argument("--secret-file", default=None)
    s.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds of silence (zmq heartbeats) after which a peer is dropped; "
                        f"0: no heartbeats (default {HEARTBEAT_TIMEOUT_S})")
    s.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("--index", type=int, default=-1, help=argparse.SUPPRESS)
    s.add_argument("--error-file", default=None, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_shard)

    d = sub.add_parser("draft", help=argparse.SUPPRESS)  # started by the coordinator
    d.add_argument("--listen", required=True)
    d.add_argument("--draft", required=True)
    d.add_argument("--target", required=True)
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--max-context", type=int, required=True)
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--block-size", type=int, default=None)
    d.add_argument("--no-graphs", action="store_true")
    d.add_argument("--no-compile", action="store_true",
                   help="run the draft's captured step uncompiled (no torch.compile)")
    d.add_argument("--random-seed", type=int, default=0)
    d.add_argument("--parent-pid", type=int, default=None)
    d.add_argument("--error-file", default=None)
    d.set_defaults(func=cmd_draft, index=-1)


# ---- shard ---------------------------------------------------------------------------------------
def cmd_shard(args: argparse.Namespace) -> int:
    from layersplit.ipc.auth import load_secret
    from layersplit.ipc.sockets import is_loopback
    from layersplit.runtime.model_store import resolve_model
    from layersplit.shards.worker import ShardSpec, run_shard

    secret = load_secret(args.secret_file)
    if secret is None:
        print("layersplit shard: no shared secret; set LAYERSPLIT_SECRET or --secret-file "
              "(the coordinator must use the same one)", file=sys.stderr)
        return 2
    if args.listen.startswith("tcp://") and not is_loopback(args.listen):
        logging.getLogger("layersplit").warning(
            "listening on %s, reachable from other hosts; peers must prove the shared secret",
            args.listen)
    try:
        start, end = (int(x) for x in args.layers.split(":"))
    except ValueError:
        print(f"layersplit shard: --layers {args.layers!r}: write START:END", file=sys.stderr)
        return 2
    try:
        model = str(resolve_model(args.model))
    except (FileNotFoundError, RuntimeError) as e:
        return _startup_error(args, str(e))
    # started by a coordinator on this host: it watches the process, no heartbeats (unless
    # asked for: a shard a Ray actor starts on another node keeps them)
    if args.heartbeat_timeout is None:
        from layersplit.runtime.config import HEARTBEAT_TIMEOUT_S

        heartbeat = None if args.parent_pid else HEARTBEAT_TIMEOUT_S
    else:
        heartbeat = args.heartbeat_timeout or None
    spec = ShardSpec(listen=args.listen, model=model, start=start, end=end, device=args.device,
                     dtype=args.dtype, threads=args.threads, parent_pid=args.parent_pid,
                     seed=args.random_seed, heartbeat_s=heartbeat,
                     weight_format=args.weight_format)
    rc = run_shard(spec, secret)
    if rc == 2 and args.error_file:
        _startup_error(args, "failed to start (see its log above)", overwrite=False)
    return rc


# ---- draft (started by the coordinator) ---------------------------------------------------------
def cmd_draft(args: argparse.Namespace) -> int:
    from layersplit.draft.server import DraftSpec, run_draft
    from layersplit.ipc.auth import load_secret
    from layersplit.runtime.model_store import resolve_model

    secret = load_secret(None)
    if secret is None:
        print("layersplit draft: no shared secret in $LAYERSPLIT_SECRET (the coordinator starts "
              "this process)", file=sys.stderr)
        return 2
    try:
        target = str(resolve_model(args.target))
    except (FileNotFoundError, RuntimeError) as e:
        return _startup_error(args, str(e))
    spec = DraftSpec(listen=args.listen, draft=args.draft, target=target,
                     max_context=args.max_context, device=args.device, dtype=args.dtype,
                     threads=args.threads, parent_pid=args.parent_pid, seed=args.random_seed,
                     block_size=args.block_size, graphs=not args.no_graphs,
                     compile=not args.no_compile)
    return run_draft(spec, secret, args.error_file)


def _startup_error(args: argparse.Namespace, text: str, overwrite: bool = True) -> int:
    print(f"layersplit {args.command}: {text}", file=sys.stderr)
    if args.error_file and (overwrite or not Path(args.error_file).exists()):
        Path(args.error_file).write_text(text)
    return 2


def _run_server_process(args: argparse.Namespace, usage_errors: tuple) -> NoReturn:
    """Run a shard or draft process and leave it without interpreter finalization.

    Once its loop has ended and its sockets and rings are closed, nothing is left to do; but
    the garbage collection of finalization blocked on CPU shards for seconds (their
    coordinator's grace period ran out, and it had to SIGTERM them), and C++ destructors of
    library threads run then (`terminate called without an active exception`). Logs and
    output are flushed, and the process exits with its code."""
    code = 1
    try:
        code = args.func(args)
    except usage_errors as e:
        print(f"layersplit {args.command}: {e}", file=sys.stderr)
        code = 2
    except SystemExit as e:  # SIGTERM (the handler raises it), or argparse
        code = e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - reported, then the same exit
        traceback.print_exc()
    finally:
        release_cuda_event_files()  # (the driver's own teardown, skipped by os._exit)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve_process(args: argparse.Namespace) -> NoReturn:
    """Run the shard or draft process `args` describe (parsed by `add_commands`' parsers); it
    ends in os._exit with the process's exit code."""
    prefix = f"[shard {args.index}] " if args.command == "shard" and args.index >= 0 else ""
    if args.command == "draft":
        prefix = "[draft] "
    setup_logging(args.verbose, prefix)
    from layersplit.shards.cuda_context import report

    report()  # (a prestarted process's context made ahead, or not: logged now)
    # `kill -USR1 PID` prints every thread's stack to stderr (a hang, seen from outside)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from layersplit.runtime.config import ConfigError
    from layersplit.shards.errors import CheckpointError

    _run_server_process(args, (ConfigError, CheckpointError, FileNotFoundError, ValueError))


def main(argv: list[str]) -> int:
    """`layersplit shard|draft ...`: a shard or draft process. Returns only when it is not
    started after all (a bad argument line on stdin: 2; its parent closed stdin: 0)."""
    from layersplit.runtime.handover import ARGV_ON_STDIN, argv_from_stdin

    if (len(argv) == 3 and argv[0] in COMMANDS
            and argv[1] == ARGV_ON_STDIN):  # started ahead for a device:
        try:  # imports first, then its arguments
            argv = argv_from_stdin(argv[2], argv[0])
        except ValueError as e:
            print(f"layersplit {argv[0]}: {e}", file=sys.stderr)
            return 2
        if argv is None:  # (its parent needed it no more)
            return 0
    p = argparse.ArgumentParser(prog="layersplit")
    p.add_argument("-v", "--verbose", action="store_true")
    add_commands(p.add_subparsers(dest="command", required=True))
    serve_process(p.parse_args(argv))
