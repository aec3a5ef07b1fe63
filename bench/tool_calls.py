"""Forced tool calls against `layersplit serve`: how many come back as valid JSON for the tool's
schema (through the `openai` client, as an agent framework calls).

    python3 bench/tool_calls.py --devices cpu,cpu --tries 100 --temperature 1.0

Half the tries name the function (`tool_choice` {"function": ...}), half say `required`; each
call's arguments are validated with `jsonschema` against the tool's `parameters`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 80},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"], "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, SEARCH)}
QUESTIONS = ["What is the weather in Paris?", "Find recent news about solar panels.",
             "Is it raining in Tokyo right now?", "Look up the population of Canada."]


def start(args) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", args.model,
           "--devices", args.devices, "--port", str(port), "--max-context", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready in 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--tries", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    proc, url = start(args)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    valid, failures, t0 = 0, [], time.perf_counter()
    try:
        served = client.models.list().data[0].id
        for i in range(args.tries):
            named = i % 2 == 0
            choice = ({"type": "function", "function": {"name": "get_weather"}} if named
                      else "required")
            r = client.chat.completions.create(
                model=served,
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=False,
                temperature=args.temperature, seed=i, max_tokens=args.max_tokens)
            ch = r.choices[0]
            try:
                (call,) = ch.message.tool_calls or ()
                tool = TOOLS[call.function.name]
                if named and call.function.name != "get_weather":
                    raise ValueError(f"called {call.function.name}, not the named function")
                jsonschema.validate(json.loads(call.function.arguments),
                                    tool["function"]["parameters"])
                valid += 1
            except (ValueError, KeyError, jsonschema.ValidationError) as e:
                failures.append({"try": i, "finish": ch.finish_reason,
                                 "content": (ch.message.content or "")[:200], "error": str(e)})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    out = {"model": args.model, "devices": args.devices, "tries": args.tries, "valid": valid,
           "temperature": args.temperature, "seconds": round(time.perf_counter() - t0, 1),
           "failures": failures[:10]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
