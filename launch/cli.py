"""`layersplit` command line: generate, serve, check, shard, cache (draft: started by the
coordinator)."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import signal
import sys
from typing import Any

from layersplit.launch import processes


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling(args: argparse.Namespace):
    from layersplit.shards.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _raise_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# ---- generate ------------------------------------------------------------------------------------
def _prestart(cfg) -> list:
    """The shard processes of a local run, and its draft process, started before this process
    imports the coordinator: their imports (torch, which the coordinator never imports) overlap
    ours (`runtime.supervisor.prestart_shards`, `prestart_draft`). Those on a CPU fork from the
    zygote instead (`_zygote_ahead`)."""
    from layersplit.runtime.model_store import (
        default_model_present,
        resolve_draft,
        resolve_model,
    )
    from layersplit.runtime.placement import PlacementError, normalize_device
    from layersplit.runtime.supervisor import prestart_draft, prestart_shards

    if cfg.launcher != "local" or any(cfg.shard_addresses or ()):
        return []
    try:  # (named as the placement names them: `cuda` is cuda:0)
        devices = [normalize_device(d) for d in cfg.devices]
        draft_device = normalize_device(cfg.draft_device or devices[0])
    except (PlacementError, IndexError):
        return []  # (the coordinator says what is wrong with them)
    forked = _zygote_ahead(cfg)
    ready = prestart_shards([d for d in devices if d not in forked])
    if cfg.model in (None, "default") and not default_model_present():
        return ready  # (not fetched yet: the coordinator fetches it, and starts the draft then)
    try:  # the coordinator's own choice (`Coordinator.draft_path`), made the same way
        draft = resolve_draft(cfg.draft, resolve_model(cfg.model), draft_device)
    except Exception:  # noqa: BLE001 - the coordinator reports it (and no draft starts ahead)
        draft = None
    if draft is not None and draft_device not in forked:
        ready += prestart_draft(draft_device)
    return ready


def _zygote_ahead(cfg) -> set[str]:
    """For a local run whose CPU shards (and CPU draft) fork from the zygote
    (`fork_cpu_processes`, `runtime.zygote`): the zygote, started now, imports while this
    process does, one interpreter for all of them; the coordinator forks them from it. The
    devices it serves ({"cpu"}, or none)."""
    from layersplit.runtime.placement import PlacementError, normalize_device
    from layersplit.runtime.zygote import ZygoteError, zygote

    if not cfg.fork_cpu_processes or cfg.launcher != "local" or any(cfg.shard_addresses or ()):
        return set()
    try:
        if "cpu" not in {normalize_device(d) for d in cfg.devices}:
            return set()
        zygote()
    except (PlacementError, ZygoteError):
        return set()  # (the coordinator says what is wrong, or starts them fresh and says why)
    return {"cpu"}


def generate_config(args: argparse.Namespace):
    """`generate`'s run: the config as given, with one request's defaults where not given: one
    KV slot (not a server's batch) and the draft's step uncompiled (its compilation, ~8 s of a
    start on an H100, would not pay back within one answer)."""
    from layersplit.runtime.config import explicit_keys, from_args

    cfg = from_args(args)
    given = explicit_keys(args)
    if "max_seqs" not in given:
        cfg = dataclasses.replace(cfg, max_seqs=1)
    if "draft_compile" not in given:
        cfg = dataclasses.replace(cfg, draft_compile=False)
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    from layersplit.draft.oracle_table import refuse_in_product
    from layersplit.runtime.supervisor import drop_prestarted

    refuse_in_product()
    cfg = generate_config(args)
    _raise_on_sigterm()
    ready = _prestart(cfg)
    try:
        return _generate(args, cfg, ready)
    finally:
        drop_prestarted(ready)  # (those no shard took: an error came first)


def _generate(args: argparse.Namespace, cfg, ready: list) -> int:
    from layersplit.runtime.config import explicit_keys
    from layersplit.runtime.coordinator import Coordinator
    from layersplit.runtime.generate import Progress, collect

    params = _sampling(args)
    coord = Coordinator(cfg, prestarted=ready)
    try:
        tok = coord.tokenizer
        if args.token_ids and args.chat:
            print("layersplit generate: --chat wraps a text prompt in the chat template; token "
                  "ids (--token-ids) are the prompt as is: give one or the other",
                  file=sys.stderr)
            return 2
        if args.token_ids:
            prompt = _token_ids(args.prompt)
            if prompt is None:
                print(f"layersplit generate: --token-ids: {args.prompt[:80]!r} is not token ids "
                      "(integers separated by commas or spaces)", file=sys.stderr)
                return 2
        elif tok is None:
            print(f"layersplit generate: {cfg.model} has no tokenizer (random weights): give "
                  "the prompt as token ids with --token-ids, e.g. --token-ids '1,2,3'",
                  file=sys.stderr)
            return 2
        elif args.chat:
            prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt = tok.encode(args.prompt)
        if "max_context" not in explicit_keys(args):  # one request: its context, no more
            coord.fit_context(len(prompt), params.max_tokens)
        coord.start()
        progress = Progress(logits=[] if args.dump_logits else None)
        deltas = coord.stream(prompt, params, progress)
        if args.json:
            result = collect(deltas, progress, len(prompt))
            print(json.dumps({**result.to_json(), "dtype": coord.dtype}, ensure_ascii=False))
        else:
            for d in deltas:
                sys.stdout.write(d.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            print(f"[{len(progress.generated)} tokens, {len(coord.shards)} shards, "
                  f"TTFT {progress.ttft_s * 1000:.0f} ms, {progress.decode_tok_s:.1f} tok/s, "
                  f"finish: {progress.finish_reason}]", file=sys.stderr)
    finally:
        coord.close()
    if args.dump_logits:
        import numpy as np

        np.save(args.dump_logits, np.stack(progress.logits).astype(np.float32))
    return 0


def _token_ids(text: str) -> list[int] | None:
    """`--token-ids`' prompt: integers separated by commas or spaces (None if it is not)."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


# ---- serve ---------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from layersplit.draft.oracle_table import refuse_in_product
    from layersplit.runtime.config import from_args

    refuse_in_product()
    cfg = from_args(args)
    _zygote_ahead(cfg)  # (before the server's imports, which it overlaps)
    try:
        from layersplit.runtime.server import serve
    except ImportError as e:
        print(f"layersplit serve needs the server extra: pip install 'layersplit[server]' ({e})",
              file=sys.stderr)
        return 2
    return serve(cfg)


# ---- warmup --------------------------------------------------------------------------------------
def cmd_warmup(args: argparse.Namespace) -> int:
    """Start the run `serve` would start with these flags, warm it up as `serve` does before
    saying ready (`runtime.warmup`: graph captures, compilation and autotuning, into the compile
    cache under the layersplit home), and stop: a later `serve` on this machine starts warm."""
    import logging
    import time

    from layersplit.runtime import warmup
    from layersplit.runtime.config import from_args
    from layersplit.runtime.coordinator import Coordinator

    cfg = from_args(args)
    _zygote_ahead(cfg)
    _raise_on_sigterm()
    t0 = time.perf_counter()
    coord = Coordinator(cfg)
    try:
        coord.start()
        warmup.run(coord, force=True)
        states = sorted({str(w.get("compile_cache", "off")) for w in coord.warmed})
        graphs = sum(int(w.get("graphs", 0)) for w in coord.warmed)
    finally:
        coord.close()
    logging.getLogger("layersplit").info(
        "warm-up done in %.1f s: %d step graphs; compile cache: %s", time.perf_counter() - t0,
        graphs, ", ".join(states) or "off")
    return 0


# ---- check ---------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    from layersplit.runtime.config import from_args

    cfg = from_args(args)
    _zygote_ahead(cfg)  # (before the check's imports, which it overlaps)
    from layersplit.runtime.check import CheckOptions, check_main
    from layersplit.runtime.check_reference import ReferenceUnavailable

    opts = CheckOptions(prompts=args.prompts, reference=args.reference,
                        reference_device=args.reference_device,
                        reference_model=args.reference_model, new_tokens=args.new_tokens,
                        limit=args.limit, batch=args.batch, restore=tuple(args.restore),
                        min_top1=args.min_top1, max_kl=args.max_kl)
    try:
        return check_main(cfg, opts, args.json)
    except ReferenceUnavailable as e:
        print(f"layersplit check: {e}", file=sys.stderr)
        return 2


# ---- cache ---------------------------------------------------------------------------------------
def cmd_cache(args: argparse.Namespace) -> int:
    from layersplit.runtime import cache_admin

    if args.action == "ls":
        return cache_admin.cmd_ls(args.dir)
    if args.action == "verify":
        return cache_admin.cmd_verify(args.dir)
    return cache_admin.cmd_prune(args.dir, args.max_gb)


# ---- parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from layersplit.runtime.config import add_flags

    p = argparse.ArgumentParser(prog="layersplit", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text across shard processes")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids separated by commas or spaces (models without "
                        "a tokenizer, such as random:NAME, take only these)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--dump-logits", metavar="FILE.npy", default=None,
                   help="save the logits each generated token was drawn from (float32, a row "
                        "per token, a stop token's included; a speculated token's from its verify "
                        "row) for tests and debugging")
    add_flags(g)
    _sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_flags(v)
    v.set_defaults(func=cmd_serve)

    w = sub.add_parser("warmup", help="compile, autotune and capture what `serve` would, into "
                       "the compile cache under $LAYERSPLIT_HOME, then exit")
    add_flags(w)
    w.set_defaults(func=cmd_warmup)

    processes.add_commands(sub)  # shard, draft

    k = sub.add_parser("check", help="compare our answers with transformers or llama.cpp, "
                       "position by position, on your model and layout")
    k.add_argument("--reference", default="transformers", choices=["transformers", "llama.cpp"],
                   help="the outside implementation (transformers: float32, the same weights)")
    k.add_argument("--reference-model", default=None, metavar="PATH",
                   help="the reference's checkpoint, if not the model's own (the same weights "
                        "in another form: the HF folder a GGUF file was made from)")
    k.add_argument("--reference-device", default=None,
                   help="where the reference runs (default: the first shard's device)")
    k.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="one JSON object a line: messages, prompt or tokens (default: 56 "
                        "bundled chat prompts)")
    k.add_argument("--limit", type=int, default=None, help="check only the first N prompts")
    k.add_argument("--new-tokens", type=int, default=64,
                   help="greedy tokens the reference writes per prompt")
    k.add_argument("--batch", type=int, default=1,
                   help="free-running requests decoded together (e.g. 8)")
    k.add_argument("--restore", action="append", default=[], choices=["ram", "disk"],
                   help="also check a prefix restored from this cache tier (repeatable; disk "
                        "restarts the runtime)")
    k.add_argument("--min-top1", type=float, default=None,
                   help="teacher-forced top-1 agreement to pass (default: 0.999 in float32, "
                        "0.99 in half types)")
    k.add_argument("--max-kl", type=float, default=None,
                   help="teacher-forced mean KL(reference || ours) to pass (default: 1e-6 in "
                        "float32, 1e-3 in half types)")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    add_flags(k)
    k.set_defaults(func=cmd_check)

    c = sub.add_parser("cache", help="inspect, verify or prune a disk-cache directory")
    c.add_argument("action", choices=["ls", "verify", "prune"])
    c.add_argument("dir")
    c.add_argument("--max-gb", type=float, default=64.0, help="prune: size to shrink to")
    c.set_defaults(func=cmd_cache)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in processes.COMMANDS:  # a shard or draft process
        return processes.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in processes.COMMANDS:  # (after a global flag: `layersplit -v shard ...`)
        processes.serve_process(args)
    processes.setup_logging(args.verbose)
    # `kill -USR1 PID` prints every thread's stack to stderr (a hang, seen from outside)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from layersplit.runtime.config import ConfigError
    from layersplit.runtime.errors import ShardFailure
    from layersplit.shards.errors import CheckpointError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"layersplit {args.command}: {e}", file=sys.stderr)
        return 2
    except ShardFailure as e:
        print(f"layersplit {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

if __name__ == "__main__":
    raise SystemExit(main())
