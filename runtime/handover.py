"""How a process started ahead gets its work: the parent (`runtime.supervisor.prestart_shards`,
`prestart_draft`, `spawn_shard`) writes one JSON line of arguments and secret on the stdin of a
process it started with `ARGV_ON_STDIN`; the process (`launch.processes.main`) imports what it
needs and then reads that line here (`argv_from_stdin`). Both sides import this module, and it
imports neither.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from layersplit.ipc.auth import SECRET_ENV

log = logging.getLogger(__name__)
ARGV_ON_STDIN = "--argv-on-stdin"  # `layersplit shard --argv-on-stdin`: a prestarted shard


def argv_from_stdin(device: str, role: str = "shard") -> list[str] | None:
    """In a prestarted shard (or draft) process for `device`: after the heavy imports (and, on
    CUDA, what it would start with), the arguments and secret its parent sends (`spawn_shard`,
    `spawn_draft`); None when the parent closed stdin without any (the process then exits).
    A line that is not what those write raises ValueError."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is its parent's to handle, as a
    # shard with a parent does: `shards.worker.run_shard`)
    from layersplit.shards.cuda_context import context_ahead

    ahead = context_ahead(device)  # (the device's context made beside torch's import, where
    # switched on)
    if role == "draft":
        import layersplit.draft.server  # (the imports that overlap the parent's)
    else:
        import layersplit.shards.worker  # noqa: F401 - the imports that overlap the parent's

    if device.startswith("cuda"):
        if ahead is not None:  # (done before torch touches the device)
            ahead.join(timeout=60)
        _get_ready_for(device)

    line = sys.stdin.readline()
    if not line:
        return None
    try:
        msg = json.loads(line)
        argv, secret = msg["argv"], bytes.fromhex(msg["secret"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a prestarted {role} read a bad line on stdin: {e}") from None
    if not (isinstance(argv, list) and argv[:1] == [role] and
            all(isinstance(a, str) for a in argv)) or not secret:
        raise ValueError(f"a prestarted {role} read a bad line on stdin: expected the {role} "
                         "command's arguments and a secret")
    os.environ[SECRET_ENV] = secret.hex()
    return argv


def _get_ready_for(device: str) -> None:
    """What a CUDA shard (or draft) does first once configured, done while it waits for its
    arguments: Triton and the decode kernels' modules imported and the device's context made.
    Not torch.compile's modules (their import alone took 5-8 s on an H100): a dense model's
    shard on the kernels compiles nothing, `generate`'s draft runs uncompiled
    (`draft_compile`), and mixture-of-experts and hybrid layers import them at their first
    step. A failure here is the process's to report once it runs: it is only logged."""
    try:
        import torch
        from layersplit.shards.device import use_device
        from layersplit.shards.kernels import fused_kernels_available

        dev = use_device(device, None)
        torch.zeros(1, device=dev)
        if fused_kernels_available(dev):
            import layersplit.shards.kernels.decode_attention
            import layersplit.shards.kernels.row_ops  # noqa: F401
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("a prestarted process could not get %s ready ahead (%s)", device, e)
