"""Two hosts on one machine: two network namespaces joined by a veth pair, one Ray node in each.

Host A (namespace `lsA<pid>`, 10.237.0.1) runs the Ray head and the coordinator; host B
(`lsB<pid>`, 10.237.0.2) a Ray worker node joined to it over the veth pair. Nothing is routed
beyond the pair: each namespace holds only its loopback and its end of the veth. Measured:

- decode tok/s of the default model on CPU, two shards placed through Ray (`--launcher ray`)
  across the two hosts (`host_a,host_b`: the edge between them is zmq over TCP, CurveZMQ) and
  both on host A (`host_a,host_a`: shared memory), the median of 3 runs each
  (`bench/decode.py --repeats 3`);
- the one-way hop latency of zmq over TCP with CurveZMQ at hidden 576 and 4096 (one token),
  between the namespaces and on loopback within host A (`bench/hop_latency.py`), the median of 3
  runs.

Needs root (`ip netns`). The namespaces (and with them the veth pair), every process in them
and the Ray nodes' temporary directories are removed on every exit: normal, an error, Ctrl-C
or SIGTERM.

    nice -n 10 python bench/ray_netns.py --json /tmp/ray_netns.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.237.0"  # a /30 on the veth pair only
PORT = 6379
WAIT_FOR_NODES = """if True:
    import sys, time, ray
    deadline = time.monotonic() + 600
    while True:  # the head's raylet registers late on a loaded machine
        try:
            ray.init(address=sys.argv[1], log_to_driver=False)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]):
        if time.monotonic() > deadline:
            sys.exit(f"{sys.argv[2]} Ray nodes did not come up within 600 s")
        time.sleep(1)
"""


class Hosts:
    """The two namespaces, their veth pair and the Ray node of each; `close` removes them."""

    def __init__(self, cpus: int) -> None:
        pid = os.getpid()
        self.ns = (f"lsA{pid}", f"lsB{pid}")
        self.ips = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.tmp = Path(tempfile.mkdtemp(prefix="ray-netns-"))
        self.cpus = cpus
        self.nodes: list[subprocess.Popen] = []
        self.made: list[str] = []

    def up(self) -> None:
        a, b = self.ns
        va, vb = f"lsva{os.getpid()}", f"lsvb{os.getpid()}"
        for ns in self.ns:
            _ip("netns", "add", ns)
            self.made.append(ns)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, ip in ((a, va, self.ips[0]), (b, vb, self.ips[1])):
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--block", "--num-cpus", str(self.cpus), "--disable-usage-stats"]
        self.nodes.append(self.run_in(0, [
            ray, "start", "--head", "--port", str(PORT), "--node-ip-address", self.ips[0],
            "--include-dashboard", "false", "--resources", '{"host_a": 8}',
            "--temp-dir", str(self.tmp / "a"), *common], background=True))
        # the head is up before the worker joins (`ray start --address` gives up after a while)
        self.run_in(0, [sys.executable, "-c", WAIT_FOR_NODES, self.address, "1"])
        self.nodes.append(self.run_in(1, [
            ray, "start", "--address", self.address, "--node-ip-address", self.ips[1],
            "--resources", '{"host_b": 8}', "--temp-dir", str(self.tmp / "b"), *common],
            background=True))
        self.run_in(0, [sys.executable, "-c", WAIT_FOR_NODES, self.address, "2"])


    @property
    def address(self) -> str:
        return f"{self.ips[0]}:{PORT}"

    def run_in(self, host: int, cmd: list[str], background: bool = False):
        """Run `cmd` in host A (0) or B (1), with this checkout's layersplit."""
        # (a node's agents start slowly on a loaded machine: the raylet waits for them longer)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_agent_register_timeout_ms": "600000"}
        full = ["ip", "netns", "exec", self.ns[host], *cmd]
        if background:  # (its output: with the nodes' logs)
            with open(self.tmp / f"ray-start-{'ab'[host]}.out", "ab") as out:
                return subprocess.Popen(full, env=env, stdout=out, stderr=subprocess.STDOUT)
        return subprocess.run(full, env=env, check=True)

    def close(self, keep_logs: str | None = None) -> None:
        """Every process in the namespaces (ours: they were made for this run) gets SIGTERM,
        then SIGKILL; their shared memory is swept; the namespaces and the veth go (the Ray
        nodes' logs are copied to `keep_logs` first, when given)."""
        sys.path.insert(0, str(ROOT))
        from layersplit.ipc.shm import sweep

        pids = [p for ns in self.made for p in _netns_pids(ns)]
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)
            pids = [p for p in pids if _alive(p)]
            if not pids:
                break
        for node in self.nodes:
            try:
                node.wait(5)
            except subprocess.TimeoutExpired:
                node.kill()
        for p in [n.pid for n in self.nodes]:
            sweep(p)
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], check=False)
        self.made = []
        if keep_logs:
            Path(keep_logs).mkdir(parents=True, exist_ok=True)
            for f in self.tmp.glob("ray-start-*.out"):
                shutil.copy(f, keep_logs)
            for host in ("a", "b"):
                logs = self.tmp / host / "session_latest" / "logs"
                if logs.is_dir():
                    shutil.copytree(logs, Path(keep_logs) / host, dirs_exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True,
                         text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def decode(hosts: Hosts, args, out: Path) -> dict:
    hosts.run_in(0, [sys.executable, str(ROOT / "bench/decode.py"), "--model", args.model,
                     "--layouts", "cpu,cpu", "cpu,cpu", "--launcher", "ray",
                     "--ray-address", hosts.address, "--ray-resources", "host_a,host_b",
                     "host_a,host_a", "--threads", "1", "--prompt-len", str(args.prompt_len),
                     "--new-tokens", str(args.new_tokens), "--prefill-chunk", "64",
                     "--repeats", "3", "--json", str(out)])
    return json.loads(out.read_text())


def hops(hosts: Hosts, args, out: Path) -> list[dict]:
    """Median over `args.hop_runs` runs of each run's median one-way latency."""
    rows: dict[tuple, list[dict]] = {}
    for run in range(args.hop_runs):
        for where, bind, prefix in (("A -> B (veth)", hosts.ips[0],
                                     f"ip netns exec {hosts.ns[1]}"),
                                    ("A -> A (loopback)", "127.0.0.1", "")):
            path = out.with_name(f"{out.stem}-{run}-{bind}.json")
            hosts.run_in(0, [sys.executable, str(ROOT / "bench/hop_latency.py"),
                             "--transports", "zmq-tcp", "--hidden", "576,4096", "--tokens", "1",
                             "--iters", str(args.iters), "--curve", "--bind", bind,
                             "--peer-prefix", prefix, "--json", str(path)])
            for r in json.loads(path.read_text()):
                rows.setdefault((where, r["hidden"]), []).append(r)
    return [{"path": where, "hidden": hidden, "runs_median_us": [r["median_us"] for r in rs],
             "median_us": statistics.median(r["median_us"] for r in rs),
             "p99_us": statistics.median(r["p99_us"] for r in rs)}
            for (where, hidden), rs in rows.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs per Ray node")
    ap.add_argument("--iters", type=int, default=300, help="round trips per hop measurement")
    ap.add_argument("--hop-runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-logs", default=None, help="copy the Ray nodes' logs here at the end")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/ray_netns.py needs root (ip netns add)")
    hosts = Hosts(args.cpus)

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        hosts.up()
        work = hosts.tmp / "out"
        work.mkdir()
        os.chmod(hosts.tmp, 0o755)
        dec = decode(hosts, args, work / "decode.json")
        hop = hops(hosts, args, work / "hop.json")
    finally:
        hosts.close(args.keep_logs)
    result = {"decode": dec, "hops": hop, "uname": os.uname().nodename,
              "cores": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\ntwo Ray nodes in two network namespaces (veth, {SUBNET}.0/30); model "
          f"{args.model}, CPU, threads 1 per shard; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens")
    print(f"{'shards on':<24} {'transport':<9} {'decode tok/s (median of 3)':>27} {'runs':>24}")
    for r in dec["rows"]:
        runs = ", ".join(f"{x:.1f}" for x in r["decode_tok_s_runs"])
        print(f"{r['layout']:<24} {r['transport']:<9} {r['decode_tok_s_median']:>27.1f} "
              f"{runs:>24}")
    print(f"\n{'zmq/tcp + CurveZMQ hop':<20} {'hidden':>6} {'one way us (median of 3)':>25} "
          f"{'p99 us':>8}")
    for r in hop:
        print(f"{r['path']:<20} {r['hidden']:>6} {r['median_us']:>25.1f} {r['p99_us']:>8.1f}")


if __name__ == "__main__":
    main()
