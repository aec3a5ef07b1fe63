"""Shards placed, started and watched through Ray (`launcher = "ray"`).

The coordinator joins a Ray cluster (or starts a one-node one), reserves a placement group with
one bundle per shard (`{"GPU": 1}` for a GPU shard, `{"CPU": threads}` for a CPU shard, plus a
sliver of a custom resource or a node-id label where the config pins a shard to a node), and
starts one `ShardHost` actor per bundle. Each actor starts its shard process on its node
(`layersplit shard --listen tcp://NODE_IP:PORT`, spawn semantics as for local shards) and owns
it: the shard exits when its actor does (`--parent-pid`), and the actor reports the shard's exit.

- Transports: every shard listens on its node's address (zmq over TCP, CurveZMQ-encrypted); the
  shard processes are told their Ray node id as their host (`ipc.hosts`), so `auto` keeps
  shared memory (or CUDA IPC) between shards of one node and uses zmq between nodes.
- Secrets: the shared secret reaches the actors through Ray's runtime environment (an
  environment variable of the actor's worker, inherited by its shard), never a command line.
- GPUs: Ray assigns each GPU bundle's actor a GPU; the shard process sees the GPUs Ray gave the
  chain's shards on its node (`cuda_visibility`), so shards of one node can still share memory.
- Supervision: each actor holds a `wait_exit` call that returns when its shard exits and fails
  when the actor (or its node) dies; the coordinator looks at it every poll (`failure`); its
  channel's heartbeats (`heartbeat_timeout`) and the step deadlines catch a lost node or a hang.
- Stop: the shards are asked to exit (by the coordinator), then each actor stops its process and
  sweeps its shared memory, the actors are killed and the placement group is removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.placement import ShardPlan

log = logging.getLogger(__name__)

RESOURCE_SLIVER = 0.001  # of a custom resource: it only picks the node, it limits nothing
NODE_ID_LABEL = "ray.io/node-id"
STOP_GRACE_S = 5.0
EXIT_REPORT_WAIT_S = 0.2  # after a dropped channel, for the shard's exit report
FAILED_STOP_S = 0.3  # how long the actors of a failed chain get to stop their shards


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(address: str = "auto") -> Any:
    """Ray, or a ConfigError saying how to install it.

    For a cluster on a loopback address (one machine, as `bench/ray_cluster.py` starts it) Ray
    must not rewrite 127.0.0.1 to the machine's interface address, where nothing listens: Ray
    reads that choice from `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` when first imported."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1") and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    # Ray's driver would take SIGTERM over (print a stack and die): layersplit's own shutdown
    # (requests drained, shards stopped in order) keeps it
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"launcher = 'ray' needs Ray, which is not installed ({e}): "
                          "pip install 'layersplit[ray]', or use launcher = 'local'") from None
    return ray


# ---- placement ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class DraftLaunch:
    """The draft process as Ray starts it, on the first shard's node: `layersplit draft`'s
    arguments after `--listen` (`supervisor.draft_argv`) and its device, `cpu` or the first
    shard's GPU (which it shares)."""

    argv: tuple[str, ...]
    device: str


def bundles(plans: Sequence[ShardPlan], cfg: RuntimeConfig,
            draft: DraftLaunch | None = None) -> list[dict[str, float]]:
    """One bundle per shard: a GPU for a GPU shard, `threads` CPUs for a CPU shard, and a
    sliver of the custom resource that pins it to a node, where the config names one. The
    draft's bundle comes last: `threads` CPUs for a CPU draft, a sliver of a CPU for one that
    shares the first shard's GPU, with the first shard's pin."""
    out = []
    for i, p in enumerate(plans):
        b: dict[str, float] = ({"GPU": 1.0} if p.device.startswith("cuda")
                               else {"CPU": float(cfg.threads or 1)})
        if cfg.ray_resources and cfg.ray_resources[i]:
            b[cfg.ray_resources[i]] = RESOURCE_SLIVER
        out.append(b)
    if draft is not None:
        b = {"CPU": RESOURCE_SLIVER if draft.device.startswith("cuda")
             else float(cfg.threads or 1)}
        if cfg.ray_resources and cfg.ray_resources[0]:
            b[cfg.ray_resources[0]] = RESOURCE_SLIVER
        out.append(b)
    return out


def label_selectors(cfg: RuntimeConfig, n: int, draft_on: str = ""
                    ) -> list[dict[str, str]] | None:
    """Per bundle (n shards, then the draft's where `draft_on` is given), the node id it must
    land on (`ray_nodes`; the draft's: the first shard's, or `draft_on`), or None when none is
    pinned."""
    nodes = list(cfg.ray_nodes[:n]) or [""] * n
    if draft_on:
        nodes[0] = nodes[0] or draft_on
        nodes.append(nodes[0])
    if not any(nodes):
        return None
    return [{NODE_ID_LABEL: node} if node else {} for node in nodes]


def cuda_visibility(nodes: Sequence[str], gpus: Sequence[Sequence[str] | None]
                    ) -> list[tuple[str, str] | None]:
    """Per shard, (CUDA_VISIBLE_DEVICES, device) for its process, None for a CPU shard.

    A shard sees the GPUs Ray assigned to the chain's shards on its node (no others), in order,
    and runs on its own one among them: shards of one node can then map each other's memory
    (cuda-ipc), and none touches a GPU Ray did not give the chain."""
    per_node: dict[str, list[str]] = {}
    for node, ids in zip(nodes, gpus, strict=True):
        for g in ids or ():
            if g not in per_node.setdefault(node, []):
                per_node[node].append(g)
    out: list[tuple[str, str] | None] = []
    for node, ids in zip(nodes, gpus, strict=True):
        if not ids:
            out.append(None)
            continue
        visible = sorted(per_node[node], key=lambda g: (len(g), g))
        out.append((",".join(visible), f"cuda:{visible.index(ids[0])}"))
    return out


# ---- the actor (runs on a node of the cluster) ------------------------------------------------
def process_env(argv: list[str], env: dict[str, str], host_id: str) -> dict[str, str]:
    """The environment of a shard or draft process a `ShardHost` starts on its node: the
    node's, the run's (`env`: the secret), its host id, and on a CUDA device the allocator and
    compile-cache settings a local shard gets (`runtime.supervisor.device_env`), under this
    node's layersplit home."""
    from layersplit.ipc.hosts import HOST_ID_ENV
    from layersplit.runtime.supervisor import device_env

    device = argv[argv.index("--device") + 1] if "--device" in argv[:-1] else "cpu"
    return device_env({**os.environ, **env, HOST_ID_ENV: host_id}, device)


class ShardHost:
    """Ray actor: starts one shard process on its node, reports when it exits, stops it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.error_file: Path | None = None

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start(self, command: str, argv: list[str], env: dict[str, str], host_id: str
              ) -> dict[str, Any]:
        """Start the shard or the draft (`layersplit shard|draft` + argv) listening on this
        node's address; the secret is in this worker's environment (Ray's runtime
        environment), the process inherits it."""
        import ray
        from layersplit.ipc.sockets import RUN_DIR_PREFIX, free_tcp_port

        ip = ray.util.get_node_ip_address()
        listen = f"tcp://{ip}:{free_tcp_port(ip)}"
        # (named like a run_dir of this worker: if the worker is killed before `stop`, the
        # next run_dir made on the host removes it, `ipc.sockets.remove_stale_run_dirs`)
        self.error_file = Path(tempfile.mkdtemp(
            prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-ray-")) / "shard.error"
        if command not in ("shard", "draft"):
            raise ValueError(f"ShardHost starts a shard or a draft, not {command!r}")
        cmd = [sys.executable, "-m", "layersplit.launch.cli", command, "--listen", listen, *argv,
               "--parent-pid", str(os.getpid()), "--error-file", str(self.error_file)]
        self.proc = subprocess.Popen(cmd, env=process_env(argv, env, host_id),
                                     stdin=subprocess.DEVNULL)
        return {"address": listen, "pid": self.proc.pid}

    def wait_exit(self) -> dict[str, Any]:
        """Returns once the shard process exited: its code and what it wrote about it."""
        while self.proc is None:
            time.sleep(0.05)
        rc = self.proc.wait()
        return {"code": rc, "error": self._error_text()}

    def _error_text(self) -> str:
        try:
            return self.error_file.read_text().strip() if self.error_file else ""
        except OSError:
            return ""

    def stop(self, grace_s: float) -> None:
        """Let the shard exit (it was asked to), then SIGTERM, then SIGKILL; sweep the shared
        memory it had not handed over; remove its error file."""
        from layersplit.ipc.shm import sweep

        p = self.proc
        if p is not None:
            for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                if sig is not None and p.poll() is None:
                    p.send_signal(sig)
                try:
                    p.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            sweep(p.pid)
        if self.error_file is not None:
            self.error_file.unlink(missing_ok=True)
            self.error_file.parent.rmdir()
            self.error_file = None


# ---- the coordinator's side ---------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class RayShard:
    """A shard started through Ray, as the coordinator supervises it (the part of the
    `supervisor.LocalProcess` interface the coordinator uses: `name`, `failure`, `error_text`,
    and `proc.wait`)."""

    plan: ShardPlan
    actor: Any
    node_id: str
    ip: str
    address: str
    pid: int  # on its node
    exit_ref: Any  # the actor's `wait_exit` call

    @property
    def name(self) -> str:
        where = f"Ray node {self.node_id[:12]} at {self.ip}"
        if self.plan.index < 0:
            return f"the draft process (on {self.plan.device}, {where})"
        return f"shard {self.plan.index} (layers {self.plan.layers} on {self.plan.device}, {where})"

    def stopped(self) -> bool:
        """(A stopped process on another node is not seen: step deadlines catch it.)"""
        return False

    @property
    def proc(self) -> RayShard:  # `_Shard.proc.proc.wait(t)`: wait for the exit report
        return self

    def wait(self, timeout: float) -> None:
        """Wait a moment for the exit report (not long: after a node loss none comes until Ray
        declares the node dead, which takes longer than failures may take to be noticed)."""
        import ray

        ray.wait([self.exit_ref], timeout=min(timeout, EXIT_REPORT_WAIT_S))

    def _outcome(self) -> str | None:
        import ray

        ready, _ = ray.wait([self.exit_ref], timeout=0)
        if not ready:
            return None
        try:
            out = ray.get(self.exit_ref)
        except ray.exceptions.RayError as e:
            return f"lost its Ray actor ({_first_line(e)})"
        rc = out["code"]
        how = (f"was killed by signal {-rc} ({signal.Signals(-rc).name})" if rc < 0
               else f"exited with code {rc}")
        return how + (f": {out['error']}" if out["error"] else "")

    def failure(self) -> str | None:
        """Why the shard is gone, naming it and its node; None while it runs."""
        why = self._outcome()
        return None if why is None else f"{self.name} {why}"

    def error_text(self) -> str:
        """What is known of its end: its exit report, else whether Ray still sees its node."""
        why = self._outcome()
        if why is not None:
            return why
        import ray

        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        if not alive.get(self.node_id, False):
            return "its Ray node is gone"
        return ("its channel dropped, and no exit was reported: its node or the network to it "
                "failed (Ray has not declared the node dead yet)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ")):
            return line[:300]
    return type(e).__name__


class RayLauncher:
    """Places and starts one chain's shards on a Ray cluster, and takes them down again."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.ray = import_ray(cfg.ray_address)
        self.cfg = cfg
        self.joined = False  # this launcher called ray.init (and so calls ray.shutdown)
        self.pg: Any = None
        self.actors: list[Any] = []
        self.shards: list[RayShard] = []
        self.draft: RayShard | None = None  # the draft process, when one is started
        self.host_id = ""  # the coordinator's Ray node, as `ipc.hosts` names hosts

    def start(self, plans: Sequence[ShardPlan], model: str, dtype: str, seed: int,
              secret: bytes, deadline: float, draft: DraftLaunch | None = None,
              weight_format: str = "dequantize") -> list[RayShard]:
        """Reserve the bundles (waiting until `deadline` for the cluster to have room), start
        an actor and its shard process on each, and the draft process (`draft`) on the first
        shard's node; returns the shards with their addresses (the draft: `self.draft`)."""
        from layersplit.ipc.auth import SECRET_ENV

        ray, cfg = self.ray, self.cfg
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect()
        self.host_id = node_host_id(ray.get_runtime_context().get_node_id())
        self._reserve(plans, draft, deadline)
        host = ray.remote(ShardHost)
        env = {SECRET_ENV: secret.hex()}
        threads = float(cfg.threads or 1)
        cpus = [0.0 if p.device.startswith("cuda") else threads for p in plans]
        if draft is not None:
            cpus.append(RESOURCE_SLIVER if draft.device.startswith("cuda") else threads)
        for i, n_cpus in enumerate(cpus):
            gpu = i < len(plans) and plans[i].device.startswith("cuda")
            self.actors.append(host.options(
                num_cpus=n_cpus, num_gpus=1 if gpu else 0, max_concurrency=4, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env}).remote())
        wheres = self._get([a.where.remote() for a in self.actors], deadline, "start actors")
        vis = cuda_visibility([w["node_id"] for w in wheres[:len(plans)]],
                              [w["gpus"] if p.device.startswith("cuda") else None
                               for w, p in zip(wheres, plans, strict=False)])
        calls = []
        for p, a, w, v in zip(plans, self.actors, wheres, vis, strict=False):
            argv = ["--model", model, "--layers", p.layers,
                    "--device", p.device if v is None else v[1], "--dtype", dtype,
                    "--weight-format", weight_format,
                    "--index", str(p.index), "--random-seed", str(seed),
                    "--threads", str(cfg.threads or 1),
                    # its node may vanish without a TCP reset: heartbeats, as a remote shard
                    "--heartbeat-timeout", str(cfg.heartbeat_timeout)]
            calls.append(a.start.remote("shard", argv, _cuda_env(v), node_host_id(w["node_id"])))
        placed = list(plans)
        if draft is not None:  # shares the first shard's GPU (and sees what it sees), or a CPU
            v = vis[0] if draft.device.startswith("cuda") else None
            argv = list(draft.argv)
            if v is not None:
                argv[argv.index("--device") + 1] = v[1]
            placed.append(ShardPlan(-1, 0, 0, draft.device if v is None else v[1], None))
            calls.append(self.actors[-1].start.remote(
                "draft", argv, _cuda_env(v), node_host_id(wheres[-1]["node_id"])))
        started = self._get(calls, deadline, "start shard processes")
        for p, a, w, s in zip(placed, self.actors, wheres, started, strict=True):
            r = RayShard(p, a, w["node_id"], w["ip"], s["address"], s["pid"],
                         a.wait_exit.remote())
            if p.index < 0:
                self.draft = r
            else:
                self.shards.append(r)
            log.info("%s: pid %d, %s", r.name, s["pid"], s["address"])
        return self.shards

    def _reserve(self, plans: Sequence[ShardPlan], draft: DraftLaunch | None,
                 deadline: float) -> None:
        """The placement group: a bundle per shard, then the draft's on the first shard's node.
        Where the config pins the first shard, the draft's bundle gets the same pin; where it
        does not, Ray may put the draft's bundle elsewhere: the group is then reserved again
        with both on the node the first shard got."""
        from ray.util.placement_group import (
            placement_group,
            placement_group_table,
            remove_placement_group,
        )

        ray, cfg = self.ray, self.cfg
        draft_on = ""
        while True:
            want = bundles(plans, cfg, draft)
            self.pg = placement_group(want, strategy=cfg.ray_strategy,
                                      name=f"layersplit-{os.getpid()}-{time.monotonic_ns()}",
                                      bundle_label_selector=label_selectors(cfg, len(plans),
                                                                            draft_on))
            ready, _ = ray.wait([self.pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                nodes = f", on nodes {list(cfg.ray_nodes)}" if any(cfg.ray_nodes) else ""
                if draft_on:
                    nodes += f", the first shard and the draft on node {draft_on}"
                drafted = " (the last: the draft process's)" if draft is not None else ""
                raise ShardFailure(
                    f"the Ray cluster cannot place {len(want)} bundles {want}{drafted} "
                    f"({cfg.ray_strategy}{nodes}) in time: it has "
                    f"{_brief(ray.available_resources())} free; add nodes or resources, or "
                    "change devices / threads / ray_resources")
            if draft is None:
                return
            on = placement_group_table(self.pg)["bundles_to_node_id"]
            if on[len(plans)] == on[0]:
                return
            if draft_on:  # (both were pinned to one node)
                raise ShardFailure(f"Ray placed the draft's bundle on node {on[len(plans)]}, "
                                   f"not on the first shard's ({on[0]}) it was pinned to")
            log.info("Ray put the draft's bundle on another node than the first shard's: "
                     "reserving again with both on node %s", on[0][:12])
            remove_placement_group(self.pg)
            self.pg, draft_on = None, on[0]

    def _connect(self) -> None:
        ray, addr = self.ray, self.cfg.ray_address
        if ray.is_initialized():  # this process joined a cluster already (a test, a notebook)
            return
        try:
            if addr == "local":
                ray.init(include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=addr, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ShardFailure(f"could not join the Ray cluster at {addr!r}: {_first_line(e)}; "
                               "start one (`ray start --head`), give ray_address HOST:PORT, or "
                               "use ray_address = 'local'") from None
        self.joined = True

    def _get(self, refs: list[Any], deadline: float, what: str) -> list[Any]:
        ray = self.ray
        try:
            return ray.get(refs, timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise ShardFailure(f"Ray: could not {what} in time (startup_timeout)") from None
        except ray.exceptions.RayError as e:
            raise ShardFailure(f"Ray: could not {what}: {_first_line(e)}") from None

    def failure(self) -> str | None:
        """Why some shard is gone (its exit, or its actor's or node's death), or None. (The
        draft's end is the coordinator's to judge: it only costs speculation.)"""
        for s in self.shards:
            why = s.failure()
            if why is not None:
                return why
        return None

    def stop_draft(self) -> None:
        """The draft failed or is given up: its process and actor go (its bundle stays
        reserved until the chain stops)."""
        d, self.draft = self.draft, None
        if d is None:
            return
        try:
            self.ray.wait([d.actor.stop.remote(0.0)], timeout=FAILED_STOP_S)
        finally:
            self.ray.kill(d.actor, no_restart=True)
            self.actors = [a for a in self.actors if a is not d.actor]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every shard process and actor, release the placement group (and leave the
        cluster if this launcher joined it). Nothing of the chain runs anywhere after this."""
        ray = self.ray
        if self.actors:
            calls = [a.stop.remote(grace_s) for a in self.actors]
            # a failed chain is not waited for: an actor on a lost node answers only once Ray
            # declares it dead, and `ray.kill` below SIGTERMs each worker's process group, its
            # shard included (which then unlinks its rings itself)
            ray.wait(calls, num_returns=len(calls),
                     timeout=grace_s + 8.0 if grace_s > 0 else FAILED_STOP_S)
            for a in self.actors:
                ray.kill(a, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as e:  # noqa: BLE001 - the cluster itself may be going away
                log.warning("could not remove the Ray placement group: %s", e)
        self.actors, self.shards, self.draft, self.pg = [], [], None, None
        if self.joined:
            ray.shutdown()
            self.joined = False


def _cuda_env(vis: tuple[str, str] | None) -> dict[str, str]:
    """A GPU process's environment: the GPUs it sees (`cuda_visibility`), no more."""
    if vis is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": vis[0],
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
            "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def node_host_id(node_id: str) -> str:
    """The host id (`ipc.hosts`) of a process on this Ray node."""
    return f"ray:{node_id}"


def _brief(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
