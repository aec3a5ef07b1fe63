"""A Ray cluster of several nodes on this machine, on loopback only: to try `--launcher ray`.

Each node gets its own custom resource (`host_a`, `host_b`, ...) to place shards with
`--ray-resources`; every Ray server listens on 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
set here before Ray is imported). Runs until Ctrl-C or SIGTERM, then stops every node.

    python bench/ray_cluster.py --nodes 2 --cpus 2
"""

from __future__ import annotations

import argparse
import os
import signal
import string
import threading


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs per node")
    args = ap.parse_args()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    common = {"num_cpus": args.cpus, "node_ip_address": "127.0.0.1"}
    names = [f"host_{string.ascii_lowercase[i]}" for i in range(args.nodes)]
    cluster = Cluster(initialize_head=True, head_node_args={
        **common, "resources": {names[0]: 64}, "include_dashboard": False})
    for name in names[1:]:
        cluster.add_node(**common, resources={name: 64})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"ray cluster: {args.nodes} nodes ({', '.join(names)}) at {cluster.address}; "
          f"use --launcher ray --ray-address {cluster.address}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
