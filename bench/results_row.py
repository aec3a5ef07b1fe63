"""Rows of bench/RESULTS.md's tables from the JSON the benches write:

    | measure | ours | baseline, same run | device | date | commit | cmd |

`bench/device.sh` calls it after each bench; by hand:

    python3 bench/results_row.py decode decode.json --llamacpp lcp.json --cmd D1
    python3 bench/results_row.py spec greedy.json --what "greedy, 2 shards on one GPU" --cmd S1
    python3 bench/results_row.py decode fp8.json --baseline bf16.json --what "FP8 kept" --cmd Q6

Kinds: decode, split, prefill, llamacpp, hop, spec, moe, concurrency, cache, structured, agent (each
reads the `--json` file of its bench), startup (`bench/startup_trace.py` logs), pytest (a pytest
log).
The device, date and commit come from --device, --date and --commit, else from
$RESULTS_DEVICE, $RESULTS_DATE and $RESULTS_COMMIT (`bench/device_env.sh` sets them), else
"—". Each printed row can be pasted into RESULTS.md as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
from pathlib import Path

DASH = "—"


def layout_words(layout: str) -> str:
    """`cuda:0` -> 1 GPU; `cuda:0,cuda:0` -> 2 shards on one GPU; `cuda:0,cuda:1` -> 2 GPUs."""
    devs = layout.split(" on ")[0].split(",")
    if len(devs) == 1:
        return "1 shard" if devs[0] != "cpu" else "1 CPU shard"
    if len(set(devs)) == 1:
        where = "one GPU" if devs[0].startswith("cuda") else "the CPU"
        return f"{len(devs)} shards on {where}"
    return f"{len(devs)} GPUs" if all(d.startswith("cuda") for d in devs) else layout


def shape(model: str) -> str:
    name = model.removeprefix("random:")
    return {"default": "default model", "smollm2-135m-shape": "default model's shape",
            "llama-8b-shape": "Llama-8B shape", "qwen3-8b": "Qwen3-8B shape",
            "qwen3-8b-chain": "Qwen3-8B shape, chain weights",
            "qwen3.5-27b": "Qwen3.5-27B shape",
            "qwen3.5-27b-chain": "Qwen3.5-27B shape, chain weights", "qwen3-32b": "Qwen3-32B shape",
            "qwen3-30b-a3b": "Qwen3-30B-A3B shape",
            "deepseek-v2-lite-shape": "DeepSeek-V2-Lite-width MLA shape"}.get(name, name)


def median(xs) -> float:
    return statistics.median(list(xs))


def runs(xs, fmt: str = "{:.1f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def llamacpp(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path else None


def baseline_row(path: str | None) -> dict | None:
    """The first row (not transformers') of another bench/decode.py run, the `--baseline`."""
    if not path:
        return None
    rows = json.loads(Path(path).read_text())["rows"]
    return next(r for r in rows if not r["layout"].startswith("HF"))


def decode(args) -> list[tuple[str, str, str]]:
    out = json.loads(Path(args.files[0]).read_text())
    lcp = llamacpp(args.llamacpp)
    floor = out.get("floor")
    ref = baseline_row(args.baseline)
    rows = []
    for i, r in enumerate(r for r in out["rows"] if not r["layout"].startswith("HF")):
        tok = r.get("decode_tok_s_median", r["decode_tok_s"])
        ours = f"**{tok:.1f}** tok/s ({runs(r.get('decode_tok_s_runs', [tok]))})"
        if floor and i == 0:
            ours += f", {tok / floor['floor_tok_s']:.1%} of the HBM floor"
        if out["prompt_len"] > 4096:  # (a long prompt: its prefill is part of the story)
            ours += f"; TTFT {r['ttft_s']:.2f} s ({runs(r['ttft_s_runs'], '{:.2f}')})"
        base = []
        if ref and i == 0:  # (another run of the shape beside it: decode and TTFT, each)
            ms = r["ttft_s"] * 1e3
            ours += f"; TTFT {ms:.1f} ms ({runs((t * 1e3 for t in r['ttft_s_runs']), '{:.1f}')})"
            rtok = ref.get("decode_tok_s_median", ref["decode_tok_s"])
            rms = ref["ttft_s"] * 1e3
            base.append(f"{args.baseline_what} {rtok:.1f} tok/s ({tok / rtok:.2f} ×), TTFT "
                        f"{rms:.1f} ms (ours {ms / rms:.2f} × as long)")
        if lcp:
            ratio = tok / lcp["wall_tok_s"]
            base.append(f"llama.cpp {lcp['wall_tok_s']:.1f} tok/s ({ratio:.2f} ×)")
        if floor:
            base.append(f"HBM floor {floor['floor_tok_s']:.0f} tok/s")
        hf = [h["decode_tok_s"] for h in out["rows"] if h["layout"].startswith("HF")]
        if hf and not math.isnan(hf[0]):  # (NaN: a prefill-only row)
            base.append(f"transformers {hf[0]:.1f} tok/s")
        what = f"{shape(out['model'])}, {layout_words(r['layout'])}, batch 1"
        rows.append((what + (f", {args.what}" if args.what else ""), ours,
                     "; ".join(base) or DASH))
    return rows


def split(args) -> list[tuple[str, str, str]]:
    out = json.loads(Path(args.files[0]).read_text())
    rows = [r for r in out["rows"] if not r["layout"].startswith("HF")]
    one = rows[0].get("decode_tok_s_median", rows[0]["decode_tok_s"])
    res = []
    for r in rows[1:]:
        tok = r.get("decode_tok_s_median", r["decode_tok_s"])
        what = f"{shape(out['model'])}, {layout_words(r['layout'])} ({r['transport']}), batch 1"
        base = f"1 GPU {one:.1f} tok/s ({runs(rows[0].get('decode_tok_s_runs', [one]))})"
        res.append((what, f"**{tok:.1f}** tok/s ({tok / one:.4f} × 1 GPU)", base))
    return res


def prefill(args) -> list[tuple[str, str, str]]:
    out = json.loads(Path(args.files[0]).read_text())
    lcp = llamacpp(args.llamacpp)
    hf = next((r for r in out["rows"] if r["layout"].startswith("HF")), None)
    ref = baseline_row(args.baseline)
    res = []
    for r in out["rows"]:
        if r["layout"].startswith("HF"):
            continue
        for key in sorted(k for k in r if re.fullmatch(r"prefill_\d+_s", k)):
            n = int(key.split("_")[1])
            s = r[key]
            ours = f"**{s:.3f} s** ({runs(r[key + '_runs'], '{:.3f}')}) = {n / s / 1e3:.1f}K tok/s"
            if ref and key in ref:
                base = (f"{args.baseline_what} {ref[key]:.3f} s "
                        f"({runs(ref[key + '_runs'], '{:.3f}')}; {ref[key] / s:.3f} ×)")
            elif hf and key in hf:
                base = f"transformers {hf[key]:.3f} s ({hf[key] / s:.3f} ×)"
            elif lcp:
                rate = median(lcp["prefill_tok_s"])
                base = f"llama.cpp {rate:,.0f} tok/s ({n / s / rate:.2f} ×)"
            else:
                base = DASH
            what = f"{shape(out['model'])}, {n:,}-token prompt, {layout_words(r['layout'])}"
            res.append((what + (f", {args.what}" if args.what else ""), ours, base))
    return res


def llamacpp_row(args) -> list[tuple[str, str, str]]:
    r = json.loads(Path(args.files[0]).read_text())
    ours = (f"decode **{r['wall_tok_s']:.1f}** tok/s ({runs(x['wall_tok_s'] for x in r['runs'])}"
            f"; eval counters {r['eval_tok_s']:.1f}); prefill "
            f"{median(r['prefill_tok_s']):,.0f} tok/s")
    return [(f"llama.cpp, {Path(r['gguf']).name}, split {r['split']}", ours, DASH)]


def hop(args) -> list[tuple[str, str, str]]:
    rows = [r for f in args.files for r in json.loads(Path(f).read_text())]
    keys = dict.fromkeys((r["transport"], r["hidden"], r["tokens"]) for r in rows)
    res = []
    for kind, hidden, tokens in keys:
        med = [r["median_us"] for r in rows if (r["transport"], r["hidden"], r["tokens"]) ==
               (kind, hidden, tokens)]
        res.append((f"{kind} hop, {tokens} token(s) of hidden {hidden}, one way",
                    f"**{median(med):.1f} µs** (median of {len(med)} runs: {runs(med)})", DASH))
    return res


def oracle_note(rs: list[dict]) -> str:
    """The bench oracle's rows: the ideal ratio and a round's split (medians over the runs)."""
    def m(key: str) -> float:
        return median(r["oracle"][key] if key in r["oracle"] else r[key] for r in rs)

    return (f"; ideal {m('ideal'):.2f} × (A × t_plain / t_verify); a round {m('round_ms'):.2f} "
            f"ms: verify {m('verify_ms'):.2f}, draft {m('draft_ms'):.2f} (computing "
            f"{m('draft_compute_ms'):.2f}), rest {m('rest_ms'):.2f}")


def spec(args) -> list[tuple[str, str, str]]:
    rows = json.loads(Path(args.files[0]).read_text())
    labels = args.labels.split(",") if args.labels else []
    groups: dict[int, list[dict]] = {}
    plain: dict[int, dict] = {}
    for run_no in sorted({r["run"] for r in rows}):
        mine = [r for r in rows if r["run"] == run_no]
        plain[run_no] = next(r for r in mine if r["draft"] == "none")
        for k, r in enumerate(r for r in mine if r["draft"] != "none"):
            groups.setdefault(k, []).append(r)
    phase = "decode_phase_tok_s" in rows[0]
    key = "decode_phase_tok_s" if phase else "decode_tok_s"
    res = []
    for k, rs in groups.items():
        ratios = [r[key] / plain[r["run"]][key] for r in rs]
        name = "the bundled draft" if rs[0]["draft"] == "default" else rs[0]["draft"]
        label = labels[k] if k < len(labels) else name
        acc = rs[0]["acceptance_length"]
        same = rs[0]["same_as_plain"]
        policy = "" if "policy=" not in rs[0]["draft"] else "; verify/plain steps " + ", ".join(
            f"{r.get('spec_rounds')}/{r.get('spec_off_steps')}" for r in rs)
        ours = (f"**{median(ratios):.2f} ×** plain ({runs(ratios, '{:.2f}')}); "
                f"{runs([r[key] for r in rs])} tok/s; acceptance "
                + ("-" if acc is None else f"{acc:.2f}") + policy
                + (f"; {same}/{rs[0]['prompts']} outputs as plain" if same is not None else "")
                + (oracle_note(rs) if "oracle" in rs[0] else ""))
        what = f"{args.what + ', ' if args.what else ''}{label}, {rs[0]['set']} prompts"
        base = f"plain {runs(plain[r['run']][key] for r in rs)} tok/s"
        res.append((what + (" (decode phase)" if phase else ""), ours, base))
    return res


# bench/moe.py's --shape -> the published model it has the shape of
MOE_SHAPES = {"30b-a3b": "Qwen3-30B-A3B", "deepseek-v2-lite": "DeepSeek-V2-Lite-width MLA",
              "gpt-oss-20b": "gpt-oss-20b",
              "glm-4.5-air": "GLM-4.5-Air", "tiny": "tiny Qwen3-MoE"}


def moe(args) -> list[tuple[str, str, str]]:
    out = json.loads(Path(args.files[0]).read_text())
    floor = out.get("floor")
    shape = MOE_SHAPES.get(out.get("shape", "30b-a3b"), out.get("shape"))
    if out.get("layers"):
        shape += f" ({out['layers']} layers)"
    res = []
    for r in out["rows"]:
        tok = r["decode_tok_s"]
        ours = f"**{tok:.1f}** tok/s ({runs(r['runs'])})"
        if floor:
            ours += f", {tok / floor['floor_tok_s']:.0%} of the HBM floor"
        base = f"HBM floor {floor['floor_tok_s']:.0f} tok/s" if floor else DASH
        res.append((f"{shape} shape, {layout_words(r['layout'])}, batch 1", ours, base))
        for n, s in r["streams"].items():
            res.append((f"{shape} shape, {layout_words(r['layout'])}, {n} streams",
                        f"**{s:.1f}** tok/s", f"batch 1 {tok:.1f} tok/s"))
    return res


def concurrency(args) -> list[tuple[str, str, str]]:
    lays = json.loads(Path(args.files[0]).read_text())
    first = {r["prompts"]: r["decode_tok_s"] for r in lays[0]["rows"]}
    res = []
    for lay in lays:
        one = lay["rows"][0]["decode_tok_s"]
        for r in lay["rows"]:
            busy = ", ".join(f"{b:.0%}" for b in r["busy"])
            ours = (f"**{r['decode_tok_s']:.1f}** tok/s; p99 ITL {r['itl_p99_ms']:.2f} ms "
                    f"({r['steady_itl_p99_ms']:.2f} once all decode); busy {busy}")
            if lay is lays[0]:
                base = f"first row {one:.1f} tok/s ({r['decode_tok_s'] / one:.2f} ×)"
            else:
                b = first.get(r["prompts"], float("nan"))
                base = f"{lays[0]['layout']} {b:.1f} tok/s ({r['decode_tok_s'] / b:.3f} ×)"
            what = f"{layout_words(lay['layout'])}, {r['prompts']} prompts"
            res.append((f"{args.what}, {what}" if args.what else what, ours, base))
        if "prefill_s" in lay:
            p0 = lays[0]["prefill_s"]
            base = f"{lays[0]['layout']} {p0:.3f} s ({p0 / lay['prefill_s']:.2f} ×)"
            res.append((f"prefill of one long prompt, {layout_words(lay['layout'])}",
                        f"**{lay['prefill_s']:.3f} s**", base))
    return res


def cache(args) -> list[tuple[str, str, str]]:
    res = []
    for r in json.loads(Path(args.files[0]).read_text()):
        ours = (f"RAM **{r['ram_s'] * 1e3:.1f} ms**; disk {r['disk_cold_s'] * 1e3:.0f} ms "
                f"(page cache dropped, {r['disk_cold_GBps']:.2f} GB/s) / "
                f"{r['disk_warm_s'] * 1e3:.0f} ms warm")
        if "disk_cold_same_tokens" in r:
            ours += f"; same greedy tokens: {r['disk_cold_same_tokens']}"
        base = (f"cold prefill {r['cold_s'] * 1e3:.0f} ms; raw read "
                f"{r['raw_read_cold_GBps']:.2f} GB/s")
        if "save_vs_raw_write" in r:
            after = (f"; {r['save_after_copy_vs_raw_write']:.2f} × after the "
                     f"{r['save_copy_wait_s']:.2f} s snapshot copy"
                     if r.get("save_after_copy_vs_raw_write") is not None else "")  # (rows
            # measured before it was, or saves that overlapped)
            ours += (f"; save {r['save_GBps']:.2f} GB/s ({r['save_vs_raw_write']:.2f} × raw "
                     f"write{after}), restore {r['restore_vs_raw_read']:.2f} × raw read")
            base += f", raw write + fsync {r['raw_write_GBps']:.2f} GB/s"
        what = f"{r['tokens']:,}-token prompt repeated"
        res.append((f"{args.what}, {what}" if args.what else what, ours, base))
    return res


def structured(args) -> list[tuple[str, str, str]]:
    return [(f"JSON schema vs free text, {layout_words(r['devices'])}",
             f"**{r['json_schema']['decode_tok_s']:.1f}** tok/s ({r['ratio']:.3f} ×)",
             f"free text {r['free']['decode_tok_s']:.1f} tok/s")
            for r in json.loads(Path(args.files[0]).read_text())]


def startup(args) -> list[tuple[str, str, str]]:
    times = []
    for f in args.files:
        found = re.findall(r"first token at ([\d.]+) s", Path(f).read_text(errors="replace"))
        if found:
            times.append(float(found[-1]))
    if not times:
        return [(args.what or "command to first token", "no `first token at` line", DASH)]
    warm = times[1:]
    ours = (f"**{median(warm):.2f} s** warm ({runs(warm, '{:.2f}')}), {times[0]:.2f} s with "
            "empty caches" if warm else f"{times[0]:.2f} s with empty caches")
    return [(args.what or "command to first token", ours, DASH)]


def pytest_log(args) -> list[tuple[str, str, str]]:
    text = Path(args.files[0]).read_text(errors="replace")
    lines = [ln.strip("= ") for ln in text.splitlines()
             if re.search(r"\d+ (passed|failed|error)", ln)]
    return [(args.what or "GPU tests", f"**{lines[-1]}**" if lines else "no summary line",
             DASH)]


def agent(args) -> list[tuple[str, str, str]]:
    """bench/agent_session.py: ours (TTFT from turn 2 on, tokens prefilled, the session's time)
    next to llama.cpp's server on the same conversation, where it ran."""
    r = json.loads(Path(args.files[0]).read_text())
    by = {x["server"]: x for x in r["results"]}

    def words(x: dict) -> str:
        later = x["turns"][1:]
        ttft = median(t["ttft_s"] for t in later) * 1e3 if later else float("nan")
        pre = [t["prefilled"] for t in later if t.get("prefilled") is not None]
        timed = [t for t in later if not t.get("restart_s") and
                 t.get("phases_ms", {}).get("prefill")]
        if timed:  # (the server's own prefill of the new tokens, beside the whole TTFT)
            ttft = median(t["ttft_s"] for t in timed) * 1e3
            pre_ms = median(t["phases_ms"]["prefill"] for t in timed)
            ratio = median(t["ttft_s"] * 1e3 / t["phases_ms"]["prefill"] for t in timed)
            return (f"TTFT from turn 2 (restart excluded) **{ttft:.1f} ms** (median), the "
                    f"new tokens' prefill {pre_ms:.1f} ms, TTFT / prefill **{ratio:.2f}**"
                    + (f", prefilled {median(pre):.0f} tokens a turn" if pre else "")
                    + f", session {x['session_s']:.1f} s")
        return (f"TTFT from turn 2 **{ttft:.0f} ms** (median)"
                + (f", prefilled {median(pre):.0f} tokens a turn" if pre else "")
                + f", session {x['session_s']:.1f} s")

    what = (f"agent session, {r['turns']} turns (system {r['system_tokens']}, tools "
            f"{r['tool_tokens']}, answers {r['answer_tokens']} tokens), {shape(r['model'])}, "
            f"{layout_words(r['devices'])}, restart at turn {r['turns'] // 2 + 1}")
    ours = by.get("layersplit")
    base = by.get("llama.cpp")
    return [(args.what or what, words(ours) if ours else "no result",
             f"llama.cpp server: {words(base)}" if base else DASH)]


def first(args) -> list[tuple[str, str, str]]:
    """bench/first_request.py: the first request's TTFT after "ready" over the median of the
    next ones', on a fresh server and after a restart (each prompt restored from the disk)."""
    r = json.loads(Path(args.files[0]).read_text())
    rows = []
    for p in r["phases"]:
        n = len(p["requests"]) - 1
        if p["phase"] == "fresh":
            when = "fresh"
        elif p.get("restored"):
            when = "after a restart, each prompt restored from the disk tier's files"
        else:
            when = "after a restart, NOT every prompt restored (see the run's log)"
        what = (f"serve, {shape(r['model'])}, {layout_words(r['devices'])}: the first request "
                f"after ready ({when}; prompts of {p.get('prompt_tokens', r['prompt_tokens']):.0f}"
                " tokens)")
        rows.append((f"{args.what}, {what}" if args.what else what,
                     f"**{p['ratio']:.2f} ×** the next {n}'s median TTFT ({p['first_ms']:.1f} "
                     f"ms against {p['rest_median_ms']:.1f}); ready in {p['ready_s']:.1f} s",
                     f"the next {n} requests, same run"))
    return rows


def switch_ab(args) -> list[tuple[str, str, str]]:
    """Batch-1 decode with a switch (`--what`, an environment variable) on against off, same
    call: bench/decode.py or bench/moe.py JSONs, the processes with it on named `*_ab1_*`,
    those with it off `*_ab0_*`; each file's rate a process's median of its runs, each side's the
    median of its processes."""
    sides: dict[str, list[float]] = {"_ab1_": [], "_ab0_": []}
    model = ""
    for path in args.files:
        out = json.loads(Path(path).read_text())
        r = out["rows"][0]
        side = next(k for k in sides if k in Path(path).name)
        sides[side].append(r.get("decode_tok_s_median", r["decode_tok_s"]))
        model = shape(out["model"]) if "model" in out else \
            f"{MOE_SHAPES.get(out.get('shape'), out.get('shape'))} shape"
    missing = [k for k, v in sides.items() if not v]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} run among {args.files} (on: *_ab1_*, "
                         f"off: *_ab0_*)")
    on, off = median(sides["_ab1_"]), median(sides["_ab0_"])
    var = args.what or "the switch"
    return [(f"{model}, 1 shard, batch 1, {var}=1",
             f"**{on:.1f}** tok/s ({runs(sides['_ab1_'])}): **{on / off:.3f} ×**",
             f"{var}=0 {off:.1f} ({runs(sides['_ab0_'])}), same call, processes in turn")]


KINDS = {"decode": decode, "split": split, "prefill": prefill, "llamacpp": llamacpp_row,
         "hop": hop, "spec": spec,
         "moe": moe, "concurrency": concurrency, "cache": cache, "structured": structured,
         "startup": startup, "pytest": pytest_log, "agent": agent, "first": first,
         "ab": switch_ab}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("files", nargs="+")
    ap.add_argument("--llamacpp", help="bench/llamacpp_decode.py's JSON: the baseline")
    ap.add_argument("--baseline", help="decode, prefill: another bench/decode.py JSON of the "
                    "shape (its first row), the baseline: decode and TTFT, or each prefill")
    ap.add_argument("--baseline-what", default="bfloat16", help="what the --baseline run is")
    ap.add_argument("--what", default="", help="what the rows measure (prefix of the label)")
    ap.add_argument("--labels", default="", help="spec: a label per draft setting, in order")
    ap.add_argument("--cmd", default=DASH, help="the command's key in RESULTS.md")
    ap.add_argument("--device", default=os.environ.get("RESULTS_DEVICE", DASH))
    ap.add_argument("--date", default=os.environ.get("RESULTS_DATE", DASH))
    ap.add_argument("--commit", default=os.environ.get("RESULTS_COMMIT", DASH))
    args = ap.parse_args()
    try:
        rows = KINDS[args.kind](args)
    except (OSError, ValueError, KeyError, IndexError, StopIteration) as e:
        rows = [(args.what or args.kind, f"no result ({type(e).__name__}: {e})", DASH)]
    for what, ours, base in rows:
        print(f"| {what} | {ours} | {base} | {args.device} | {args.date} | {args.commit} | "
              f"{args.cmd} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
