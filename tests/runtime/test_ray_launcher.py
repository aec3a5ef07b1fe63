"""launcher = "ray": shards placed, started and supervised on a Ray cluster.

One two-node cluster (`ray.cluster_utils.Cluster`, nodes `node_a` and `node_b`, each known by its
own custom resource) serves every test of the module; it listens on loopback only.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import psutil
import pytest
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.ray_launcher import RayLauncher, cuda_visibility
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import layersplit_shm, trace, wait_gone

# Ray binds its servers to every interface and rewrites 127.0.0.1 to the machine's address
# unless told it runs without a cluster network: keep all of it on loopback. Read when ray is
# first imported, which is below (ray is a test dependency: the `test` extra installs it).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from ray.cluster_utils import Cluster

NODE = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


def _add_node_b(cluster: Cluster):
    return cluster.add_node(**NODE, resources={"node_b": 4})


@pytest.fixture(scope="module")
def cluster():
    shm_before = layersplit_shm()
    c = Cluster(initialize_head=True, head_node_args={
        **NODE, "resources": {"node_a": 4}, "include_dashboard": False})
    _add_node_b(c)
    ray.init(address=c.address, log_to_driver=False)
    pids = [p.pid for p in psutil.Process().children(recursive=True)]
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


@pytest.mark.slow
def test_chain_across_two_nodes_is_exact_and_its_cache_restores_on_one(cluster, tiny_llama,
                                                                       tmp_path):
    """Three shards on two nodes: logits equal the reference engine's bit for bit, the edge
    between the nodes is zmq over TCP and the one within node_b shared memory; the disk-cache
    entry the chain wrote (node_b's tensors streamed to this host) restores after a restart into
    a chain of two shards, both on node_b (its tensors streamed back)."""
    cfg = _config(tiny_llama, devices=("cpu",) * 3, split=(2, 2, 2),
                  ray_resources=("node_a", "node_b", "node_b"), kv_cache_dir=str(tmp_path))
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("ray places the shards across two nodes " * 2)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    want = ref.generate(prompt, p)
    with Coordinator(cfg) as coord:
        info = coord.shard_info()
        nodes = [s.node_id for s in coord.ray.shards]
        assert nodes[0] != nodes[1] == nodes[2]
        assert [i["transport_out"] for i in info] == ["zmq", "shm", "none"]
        assert all(s.address.startswith("tcp://127.0.0.1:") for s in coord.shards)
        streams = [s.streams_cache for s in coord.shards]
        assert streams == [n != coord.host.removeprefix("ray:") for n in nodes] and any(streams)
        got_tokens, got_logits = trace(coord, prompt[:20], 4, 16)
        ref_tokens, ref_logits = trace(ref, prompt[:20], 4, 16)
        assert got_tokens == ref_tokens and np.array_equal(got_logits, ref_logits)
        assert coord.generate(prompt, p).tokens == want.tokens
        pids, actors, pg = [i["pid"] for i in info], _actor_pids(coord), coord.ray.pg
    _gone(pids, actors, pg)
    assert sorted(tmp_path.glob("*.safetensors"))
    one_node = cfg.replace(devices=("cpu", "cpu"), split=(3, 3),
                           ray_resources=("node_b", "node_b"))
    with Coordinator(one_node) as coord:
        here = coord.host.removeprefix("ray:")
        assert [s.streams_cache for s in coord.shards] == [
            s.node_id != here for s in coord.ray.shards]
        r = coord.generate(prompt, p)
        assert (r.cache_tier, r.cached_tokens, r.tokens) == ("disk", len(prompt), want.tokens)
        pids, actors, pg = [i["pid"] for i in coord.shard_info()], _actor_pids(coord), \
            coord.ray.pg
    _gone(pids, actors, pg)


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
        t0 = time.monotonic()
        cluster.remove_node(node_b, allow_graceful=False)
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
        Coordinator(cfg.replace(startup_timeout=3)).start()
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
