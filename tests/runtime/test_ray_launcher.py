"""launcher = "ray": shards placed, started and supervised on a Ray cluster.

One two-node cluster (`ray.cluster_utils.Cluster`, nodes `node_a` and `node_b`, each known by its
own custom resource) serves every test of the module; it listens on loopback only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import psutil
import pytest
from layersplit.ipc.messages import message
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.placement import PlacementError, ShardPlan
from layersplit.runtime.ray_launcher import (
    NODE_ID_LABEL,
    RESOURCE_SLIVER,
    DraftLaunch,
    RayLauncher,
    bundles,
    cuda_visibility,
    label_selectors,
)
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import (
    assert_same_run,
    layersplit_shm,
    run_logged,
    run_speculated,
    trace,
    wait_gone,
)

# Ray binds its servers to every interface and rewrites 127.0.0.1 to the machine's address
# unless told it runs without a cluster network: keep all of it on loopback. Read when ray is
# first imported, which is below (ray is a test dependency: the `test` extra installs it).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")  # (absent on a GPU machine that runs `pytest -m gpu tests`)
Cluster = pytest.importorskip("ray.cluster_utils").Cluster

NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


def _add_node_b(cluster: Cluster):
    return cluster.add_node(**NODE, resources={"node_b": 4})


@pytest.fixture(scope="module")
def cluster():
    shm_before = layersplit_shm()
    # (no idle workers started for this driver: the chain's actors carry a runtime environment
    # of their own, so Ray starts their workers anew and those would only burn CPU meanwhile)
    c = Cluster(initialize_head=True, head_node_args={
        **NODE, "resources": {"node_a": 4}, "include_dashboard": False,
        "_system_config": {"prestart_worker_first_driver": False}})
    _add_node_b(c)
    ray.init(address=c.address, log_to_driver=False)
    # the cluster's processes (not the zygote this test run's CPU shards fork from, nor those)
    pids = [p.pid for p in psutil.Process().children(recursive=True)
            if "runtime.zygote" not in " ".join(p.cmdline())]
    for pid in pids:  # every socket of the cluster is on loopback
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        exposed = [c.laddr for c in conns if c.status == psutil.CONN_LISTEN
                   and c.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
        assert not exposed, f"a Ray process listens beyond loopback: {exposed}"
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        assert wait_gone(pids, timeout=20) == []
        assert layersplit_shm() - shm_before == set()


PLANS = (ShardPlan(0, 0, 3, "cpu", None), ShardPlan(1, 3, 6, "cuda:0", None))


def _config(model, **kw) -> RuntimeConfig:
    base = {"model": str(model), "launcher": "ray", "prefill_chunk": 16, "threads": 1,
            "max_context": 256, "startup_timeout": 120}
    return RuntimeConfig(**{**base, **kw})


def _gone(coord_pids: list[int], actor_pids: list[int], pg) -> None:
    """Nothing of a stopped chain runs: shard processes, actors, its placement group."""
    assert wait_gone(coord_pids + actor_pids, timeout=15) == []
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def _actor_pids(coord: Coordinator) -> list[int]:
    return [w["pid"] for w in ray.get([a.where.remote() for a in coord.ray.actors])]


def _driver_and_other_node() -> tuple[str, str]:
    """The custom resources (node_a / node_b) of the node this test process drives the cluster
    from (the coordinator's host) and of the other one."""
    here = ray.get_runtime_context().get_node_id()
    names = {n["NodeID"]: next(r for r in ("node_a", "node_b") if r in n["Resources"])
             for n in ray.nodes() if n["Alive"]}
    return names[here], ({"node_a", "node_b"} - {names[here]}).pop()


def _feature_rows(coord: Coordinator, n: int) -> bytes:
    """The draft's feature rows of positions [0, n) of context 0."""
    reply = coord.draft_request(message("draft_features", slot=0, start=0, end=n,
                                        sync=coord.feat_sid(0)))
    return bytes(reply["_frames"][0].buffer)


@pytest.mark.slow
def test_chain_across_two_nodes_is_exact_and_its_cache_restores_on_one(cluster, target, dflash,
                                                                       tmp_path):
    """Three shards on two nodes and a DFlash draft: logits equal the reference engine's bit
    for bit, speculative output equals plain output; the edge between the nodes is zmq over TCP
    and the one within a node shared memory, and so are the draft's feature edges (the draft
    runs on the first shard's node, as Ray reports); the secret reaches no command line. The
    disk-cache entry the chain wrote (tensors of the nodes the coordinator is not on, the
    draft's feature rows included, streamed to this host) restores after a restart into a
    one-shard chain on one node (streamed back), the draft's rows bit-equal. The draft
    process killed there costs speculation only: the chain serves on, its actor is gone."""
    here, there = _driver_and_other_node()  # the first shard (and the draft) away from here
    cfg = _config(target, devices=("cpu",) * 3, split=(2, 2, 2), draft=str(dflash),
                  ray_resources=(there, here, here), kv_cache_dir=str(tmp_path))
    ref = ReferenceEngine(target, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("ray places the shards across two nodes " * 2)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    ref_run = run_logged(ref, prompt, p)
    want = ref_run[0]
    with Coordinator(cfg) as coord:
        info = coord.shard_info()
        nodes = [s.node_id for s in coord.ray.shards]
        assert nodes[0] != nodes[1] == nodes[2]
        assert [i["transport_out"] for i in info] == ["zmq", "shm", "none"]
        assert [i["transport_feed"] for i in info] == ["shm", "none", "zmq"]  # taps 1, 4
        assert all(s.address.startswith("tcp://127.0.0.1:") for s in coord.shards)
        draft = coord.ray.draft
        assert ray.get(draft.actor.where.remote())["node_id"] == nodes[0] == draft.node_id
        on = ray.util.placement_group_table(coord.ray.pg)["bundles_to_node_id"]
        assert on[3] == on[0] == nodes[0]  # the draft's own bundle, on the first shard's node
        streams = [s.streams_cache for s in coord.shards]
        assert streams == [n != coord.host.removeprefix("ray:") for n in nodes] == [
            True, False, False]
        assert coord.draft.streams_cache
        _secret_on_no_command_line(coord, [draft.pid, *(i["pid"] for i in info)])
        got_tokens, got_logits = trace(coord, prompt[:20], 4, 16)
        ref_tokens, ref_logits = trace(ref, prompt[:20], 4, 16)
        assert got_tokens == ref_tokens and np.array_equal(got_logits, ref_logits)
        spec, logits, stats = run_speculated(coord, prompt, p, use_cache=True)
        assert stats.verifies > 0
        assert_same_run((spec, logits), ref_run, "speculated")  # float32 logits, bit for bit
        rows = _feature_rows(coord, len(prompt))
        assert coord.generate(prompt, p, use_cache=False, speculative=False).tokens == \
            want.tokens
        pids, actors, pg = [i["pid"] for i in info] + [draft.pid], _actor_pids(coord), \
            coord.ray.pg
    _gone(pids, actors, pg)
    assert sorted(tmp_path.glob("*.safetensors"))
    one_node = cfg.replace(devices=("cpu",), split=(6,), ray_resources=(there,))
    with Coordinator(one_node) as coord:
        assert [s.streams_cache for s in coord.shards] == [True]
        assert coord.draft.streams_cache and coord.ray.draft.node_id == coord.ray.shards[0].node_id
        r, logits, _ = run_speculated(coord, prompt, p, use_cache=True)
        assert (r.cache_tier, r.cached_tokens) == ("disk", len(prompt))
        assert_same_run((r, logits), ref_run, "restored")
        assert _feature_rows(coord, len(prompt)) == rows
        draft = coord.ray.draft
        pids, actors, pg = [i["pid"] for i in coord.shard_info()] + [draft.pid], \
            _actor_pids(coord), coord.ray.pg
        os.kill(draft.pid, signal.SIGKILL)  # costs speculation, not the chain: its actor goes
        assert coord.generate(prompt, p, use_cache=False).tokens == want.tokens
        assert coord.draft is None and coord.ray.draft is None
        assert f"the draft process (on cpu, Ray node {draft.node_id[:12]}" in coord.draft_down
        assert draft.actor not in coord.ray.actors and len(coord.ray.actors) == 1
    _gone(pids, actors, pg)


def _secret_on_no_command_line(coord: Coordinator, pids: list[int]) -> None:
    """The run's secret is in the environment of its actors and their processes (Ray's runtime
    environment), never on a command line."""
    secret = coord.secret.hex()
    actors = _actor_pids(coord)
    everything = psutil.Process().children(recursive=True)  # the cluster's processes too
    assert set(actors + pids) <= {p.pid for p in everything}
    for proc in everything:
        try:
            line = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert secret not in line, f"the secret is on the command line of pid {proc.pid}"
    for pid in actors + pids:
        assert psutil.Process(pid).environ().get("LAYERSPLIT_SECRET") == secret
    assert set(pids) <= {c.pid for a in actors for c in psutil.Process(a).children()}


@pytest.mark.slow
def test_node_loss_mid_request_is_named_within_2s_and_the_chain_is_placed_again(
        cluster, tiny_llama):
    """node_b dies (its raylet and every process of it killed) while a request decodes: the
    request fails within 2 s naming the shard and its node, nothing of the chain is left; the
    chain cannot be placed while no node has node_b (a clear error), and serves again once one
    joins."""
    cfg = _config(tiny_llama, devices=("cpu", "cpu"), split=(3, 3), max_context=2048,
                  ray_resources=("node_a", "node_b"))
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=2048)
    prompt = ref.tokenizer.encode("a node is lost while this request decodes")
    coord = Coordinator(cfg)
    coord.start()
    try:
        pids, actors, pg = [i["pid"] for i in coord.shard_info()], _actor_pids(coord), \
            coord.ray.pg
        lost = coord.ray.shards[1].node_id
        node_b = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
        stream = coord.stream(prompt, SamplingParams(max_tokens=1900, ignore_eos=True),
                              Progress())
        next(stream)  # decoding
        cluster.remove_node(node_b, allow_graceful=False)  # (returns once its processes died)
        t0 = time.monotonic()  # (the 2 s count from the loss, not from the removal's work)
        with pytest.raises(ShardFailure) as failed:
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 2.0
        assert "shard 1 (layers 3:6" in str(failed.value)
        assert f"Ray node {lost[:12]}" in str(failed.value)
    finally:
        coord.close()
    _gone(pids, actors, pg)
    with pytest.raises(ShardFailure, match="cannot place 2 bundles"):
        Coordinator(cfg.replace(startup_timeout=1)).start()  # (waits that long for nothing)
    _add_node_b(cluster)
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    with Coordinator(cfg) as coord:
        assert coord.generate(prompt, p).tokens == ref.generate(prompt, p).tokens


def test_launcher_ray_without_ray_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'layersplit\[ray\]'"):
        RayLauncher(RuntimeConfig(launcher="ray"))


def test_ray_keys_are_checked():
    with pytest.raises(ConfigError, match="applies to launcher = 'ray'"):
        RuntimeConfig(ray_resources=("a", "b"))
    with pytest.raises(ConfigError, match="do not mix"):
        RuntimeConfig(launcher="ray", shard_addresses=("", "tcp://10.0.0.2:7700"))
    with pytest.raises(ConfigError, match="ray_nodes has 1 entries for 2 devices"):
        RuntimeConfig(launcher="ray", ray_nodes=("abc",))
    with pytest.raises(ConfigError, match="STRICT_SPREAD"):
        RuntimeConfig(launcher="ray", ray_strategy="spread")


def test_gpu_shards_see_the_gpus_ray_gave_the_chain_on_their_node():
    vis = cuda_visibility(["n1", "n1", "n2", "n1"], [["3"], ["1"], ["0"], None])
    assert vis == [("1,3", "cuda:1"), ("1,3", "cuda:0"), ("0", "cuda:0"), None]


def test_the_draft_gets_a_bundle_of_its_own_on_the_first_shards_node():
    cfg = RuntimeConfig(launcher="ray", devices=("cpu", "cuda:0"), threads=2,
                        ray_resources=("host_a", "host_b"))
    cpu_draft = DraftLaunch(("--device", "cpu"), "cpu")
    assert bundles(PLANS, cfg, cpu_draft) == [
        {"CPU": 2.0, "host_a": RESOURCE_SLIVER}, {"GPU": 1.0, "host_b": RESOURCE_SLIVER},
        {"CPU": 2.0, "host_a": RESOURCE_SLIVER}]
    gpu_first = cfg.replace(devices=("cuda:0", "cuda:1"), ray_resources=())
    assert bundles(PLANS, gpu_first, DraftLaunch((), "cuda:0"))[-1] == {"CPU": RESOURCE_SLIVER}
    pinned = cfg.replace(ray_resources=(), ray_nodes=("n1", ""))
    assert label_selectors(pinned, 2) == [{NODE_ID_LABEL: "n1"}, {}]
    assert label_selectors(pinned, 2, draft_on="n2") == [{NODE_ID_LABEL: "n1"}, {},
                                                         {NODE_ID_LABEL: "n1"}]
    unpinned = cfg.replace(ray_resources=())
    assert label_selectors(unpinned, 2) is None
    assert label_selectors(unpinned, 2, draft_on="n2") == [{NODE_ID_LABEL: "n2"}, {},
                                                           {NODE_ID_LABEL: "n2"}]


def test_a_draft_under_ray_runs_on_the_first_shards_device_or_a_cpu(tiny_llama, tmp_path):
    with pytest.raises(PlacementError, match="on its device \\(cuda:0\\) or on cpu"):
        Coordinator(RuntimeConfig(model=str(tiny_llama), launcher="ray",
                                  devices=("cuda:0", "cuda:1"), draft=str(tiny_llama),
                                  draft_device="cuda:1"))
