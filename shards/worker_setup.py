"""A shard's set-up: `configure` (its KV pool, host pool, token board and rings), the links
to the next shard and to the draft process, the graphs captured at start, what it reports of
itself (`info`), and the links' teardown.

`ShardSetup` is one part of `shards.worker.ShardServer` (its state is set in
`ShardServer.__init__`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psutil
import torch
import zmq
from layersplit.ipc import transport
from layersplit.ipc.messages import PROTOCOL_VERSION, ProtocolError, message
from layersplit.ipc.peers import expect, handshake
from layersplit.ipc.sockets import connect_dealer, request, ring_doorbell
from layersplit.ipc.token_board import TokenBoard
from layersplit.ipc.transport import ZmqSender
from layersplit.shards import compile_cache, hybrid_prewarm
from layersplit.shards.executor import MAX_VERIFY_ROWS, RangeExecutor
from layersplit.shards.fused import fuse_projections, warm_prefill
from layersplit.shards.host_kv import HostKVPool
from layersplit.shards.hybrid_cache import HybridState
from layersplit.shards.snapshots import SnapshotStore

log = logging.getLogger("layersplit.shard")
LINK_TIMEOUT_S = 60.0
FEED_TIMEOUT_S = 2.0  # a draft that takes no rows for this long is dropped, the step goes on
FEED_ROWS = 1024  # rows per feature message (a long prefill chunk is sent in pieces)
PROPOSAL_BYTES = 64  # a `drafted` message is all header: its ring slots need no payload
MAX_SLOTS = 1024  # sequences a shard's KV cache may hold
MAX_BLOCK_TOKENS = 4096  # rows of one KV block


class ShardSetup:
    """The messages that set a shard up (`configure`, `link`, `warm`) and its links."""

    def _on_configure(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self.index = int(msg.get("index", self.index))
        self.late_masks.clear()
        self.awaiting = None
        self._close_links()
        self.held, self.drafted, self.draft_gone, self.bad_drafted = None, {}, None, {}
        self.queued.clear()
        self.early.clear()
        self.unsent.clear()  # (a new configuration: results of the steps before it are void)
        max_ctx, max_step = msg["max_context"], msg["max_step_tokens"]
        slots, block, blocks = msg["slots"], msg["kv_block"], msg["kv_blocks"]
        if max_ctx <= 0 or max_step <= 0 or not 1 <= slots <= MAX_SLOTS:
            raise ProtocolError(f"configure: max_context and max_step_tokens must be > 0, slots "
                                f"1..{MAX_SLOTS}")
        if not 1 <= block <= MAX_BLOCK_TOKENS or blocks < 1:
            raise ProtocolError(f"configure: kv_block={block} must be 1..{MAX_BLOCK_TOKENS} and "
                                f"kv_blocks={blocks} at least 1")
        graphs = bool(msg.get("cuda_graphs", True)) and self.device.type == "cuda"
        taps = msg.get("taps") or []
        if not isinstance(taps, list) or not all(
                isinstance(t, int) and self.spec.start <= t < self.spec.end for t in taps):
            raise ProtocolError(f"configure: taps {taps!r} must be layers of "
                                f"{self.spec.start}:{self.spec.end}")
        if self.device.type == "cuda" and not self.fused:
            fuse_projections(self.model, compile=bool(msg.get("torch_compile", True)))
            self.fused = True
        bucket = int(msg.get("graph_bucket", 256))
        self.spin_s = max(0.0, float(msg.get("spin_ms", 0.0))) / 1000.0
        ex = self.executor
        if ex is None or ex.max_len != max_ctx or ex.kv.slots != slots or \
                ex.paged != (blocks, block) or \
                (ex.static is not None) != graphs or \
                (ex.static is not None and ex.static.bucket != bucket) or ex.taps != tuple(taps):
            self.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.executor = RangeExecutor(self.model, max_ctx, slots, self.device,
                                          static_decode=graphs, graph_bucket=bucket,
                                          taps=tuple(taps), paged=(blocks, block))
            kv = self.executor.kv
            whole, forget = None, None
            if isinstance(kv, HybridState):
                whole, forget = {"conv": kv.conv, "state": kv.state}, kv.forget
            log.info("shard %d: KV pool of %d blocks of %d tokens (%.0f MB)", self.index, blocks,
                     block, kv.nbytes / 2**20)
            self.snapshots = SnapshotStore(kv.snapshot_rows(), max_ctx, whole, forget)
        self.executor.deterministic = bool(msg.get("deterministic", False))
        host_blocks = msg.get("kv_host_blocks", 0)
        if not isinstance(host_blocks, int) or isinstance(host_blocks, bool) or host_blocks < 0:
            raise ProtocolError(f"configure: kv_host_blocks={host_blocks!r} must be an int >= 0")
        kv = self.executor.kv
        if self.host_kv is None or self.host_kv.num_blocks != host_blocks or \
                self.host_kv.kv is not kv:
            if self.host_kv is not None:
                self.host_kv.close()  # (its page-locked buffers given back)
            self.host_kv = None
            if host_blocks:
                self.host_kv = HostKVPool(kv, host_blocks)
                log.info("shard %d: host KV pool of up to %d blocks (%.0f MB, taken as "
                         "sequences are swapped out)", self.index, host_blocks,
                         host_blocks * self.host_kv.block_bytes / 2**20)
        self.taps = tuple(taps)
        info_extra: dict[str, Any] = {}
        if self.model.is_first and self.model.is_last:
            self.board = TokenBoard.local(slots, self.device)
        elif self.model.is_last and msg.get("board") is True:  # lookahead on a split runtime
            self.board, info_extra["board"] = TokenBoard.create(slots, self.device)
        elif self.model.is_first and msg.get("board") is not None:  # the last shard's board
            self.board = TokenBoard.attach(msg["board"], slots, self.device)
            info_extra["board"] = self.board is not None
        self.cache_dir = msg.get("cache_dir")
        self.max_step = max_step
        if self.model.is_first and msg.get("inbox"):  # the coordinator shares this host
            # token ids stay on the host until checked (`_segments`)
            self.inbox, desc = transport.offer("shm", max_step * 8, torch.device("cpu"))
            info_extra["inbox"] = desc
        if self.taps and msg.get("draft") is not None:
            self._link_draft(msg["draft"], msg["session"])
        nxt = msg["next"]
        if nxt is not None:
            self._link_downstream(nxt, msg["session"], msg["transport"])
        elif self.model.is_last:
            results = msg.get("results")
            if results is not None:  # the coordinator's result ring
                coordinator = self.coordinator

                def doorbell() -> None:
                    ring_doorbell(self.router, coordinator)

                self.out = transport.accept("shm", results, doorbell)
            else:
                self.out = ZmqSender(self.router, route)
        self._reply(route, message("configured", info={**self.info(), **info_extra}))

    def _dealer(self, address: Any, session: bytes, what: str) -> zmq.Socket:
        """A DEALER socket connected and authenticated to another server of this run."""
        if not isinstance(address, str):
            raise ProtocolError(f"configure: {what} address must be a string")
        ident = f"shard{self.index}-{what}-".encode() + session[:8] + os.urandom(4)
        sock = connect_dealer(self.ctx, address, self.secret, identity=ident,
                              heartbeat_s=self.spec.heartbeat_s)
        try:
            handshake(sock, self.secret, "upstream" if what == "next" else "feeder",
                      LINK_TIMEOUT_S, f"the {what} process")
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _link_downstream(self, nxt: dict[str, Any], session: bytes, requested: str) -> None:
        self.down = down = self._dealer(nxt.get("address"), session, "next")
        reply, _ = request(down, message(
            "link", transport=requested, host=transport.host_id(), device=self.spec.device,
            dtype=self.spec.dtype, hidden=self.cfg.hidden_size, max_step_tokens=self.max_step,
        ), LINK_TIMEOUT_S)
        expect(reply, "linked", "the downstream shard")
        self.out = transport.accept(reply["transport"], reply["ring"],
                                    lambda: ring_doorbell(down), sock=down)
        self.transport_kind = reply["transport"]
        self.poller.register(down, zmq.POLLIN)

    def _link_draft(self, desc: Any, session: bytes) -> None:
        """Feature rows of this shard's tapped layers go to the draft process."""
        if not isinstance(desc, dict):
            raise ProtocolError("configure: draft must be a map")
        self.feed_sock = sock = self._dealer(desc.get("address"), session, "draft")
        width = len(self.taps) * self.cfg.hidden_size
        ring = None
        if self.model.is_first:  # proposals the draft hands this shard come through shm
            self.proposals, ring = transport.offer("shm", PROPOSAL_BYTES, torch.device("cpu"))
        reply, _ = request(sock, message(
            "feed", transport=str(desc.get("transport", "auto")), host=transport.host_id(),
            device=self.spec.device, dtype=self.spec.dtype, layers=list(self.taps), width=width,
            max_rows=min(self.max_step, FEED_ROWS), proposals=ring), LINK_TIMEOUT_S)
        expect(reply, "linked", "the draft process")
        sock.setsockopt(zmq.SNDTIMEO, int(FEED_TIMEOUT_S * 1000))
        self.feed_kind = reply["transport"]
        self.parked.clear()  # (rows parked for a draft process before this one)
        self.feed = transport.accept(reply["transport"], reply["ring"],
                                     lambda: ring_doorbell(sock), sock=sock)
        if isinstance(self.feed, transport.RingSender):
            self.feed.timeout_s = FEED_TIMEOUT_S
        self.poller.register(sock, zmq.POLLIN)

    def _on_link(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        try:
            kind = transport.resolve(msg["transport"], msg["host"], msg["device"], self.spec.device)
        except ValueError as e:
            raise ProtocolError(str(e), "bad_transport") from e
        if msg["hidden"] != self.cfg.hidden_size:
            raise ProtocolError(f"link: hidden size {msg['hidden']} != {self.cfg.hidden_size}")
        if msg["dtype"] not in transport.ITEMSIZE:
            raise ProtocolError(f"link: unknown dtype {msg['dtype']!r}")
        itemsize = transport.ITEMSIZE[msg["dtype"]]
        payload = msg["max_step_tokens"] * msg["hidden"] * itemsize
        if self.inbox is not None:
            self.inbox.close()
        self.inbox, desc = transport.offer(kind, payload, self.device)
        self.upstream = route  # the peer that linked is the one whose steps we take
        self._reply(route, message("linked", transport=kind, ring=desc))

    def info(self) -> dict[str, Any]:
        ex = self.executor
        if self.device.type == "cuda":
            mem = torch.cuda.memory_allocated(self.device)
        else:
            mem = psutil.Process().memory_info().rss
        return {
            "index": self.index, "layers": [self.spec.start, self.spec.end],
            "device": self.spec.device, "dtype": self.spec.dtype, "pid": os.getpid(),
            "weight_format": self.spec.weight_format,
            "memory_bytes": int(mem), "load_s": round(self.load_s, 3),
            "kv_capacity_tokens": ex.kv.num_blocks * ex.kv.block if ex else 0,
            "kv_blocks": ex.kv.num_blocks if ex else 0, "kv_block": ex.kv.block if ex else 0,
            "slots": ex.kv.slots if ex else 0,
            "deterministic": bool(ex and ex.deterministic),
            "kv_bytes": ex.kv.nbytes if ex else 0,
            "kv_host_blocks": self.host_kv.num_blocks if self.host_kv else 0,
            "kv_host_bytes": self.host_kv.nbytes if self.host_kv else 0,
            "kv_layout": self._kv_layout(),
            "transport_out": self.transport_kind, "transport_feed": self.feed_kind,
            "protocol": PROTOCOL_VERSION,
        }

    def _kv_layout(self) -> dict[str, Any]:
        """What this shard's prefix-cache tensors are: K/V rows of `layers` layers, and on a
        hybrid model which global layers those are (`attn_layers`) and the state of its
        linear-attention layers (`linear_layers`: conv and recurrent state shapes)."""
        lay: dict[str, Any] = {"layers": self.spec.end - self.spec.start,
                               "kv_heads": self.cfg.kv_row[0], "head_dim": self.cfg.kv_row[1],
                               "dtype": self.spec.dtype}
        model = self.model
        if getattr(model, "spec", None) is not None:  # a hybrid range
            sp = model.spec
            lay.update(layers=len(model.attn_layers), attn_layers=list(model.attn_layers),
                       linear_layers=list(model.linear_layers),
                       conv_shape=[sp.conv_dim, sp.conv_kernel - 1],
                       state_shape=[sp.num_value_heads, sp.key_head_dim, sp.value_head_dim],
                       state_dtype="float32")
        return lay

    def _on_warm(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Capture the step graphs a request may replay, before any request
        (`StaticDecoder.warm`); a CPU shard, or one without graphs, has none to capture."""
        rows, batch = msg["rows"], msg["batch"]
        verify_batch = msg.get("verify_batch", 0)  # (optional: batched verify steps)
        if self.executor is None:
            raise ProtocolError("warm before configure")
        if not rows or not all(type(n) is int and 1 <= n <= self.max_step for n in rows):
            raise ProtocolError(f"warm: rows {str(rows)[:80]} must be 1..{self.max_step}")
        for name, value in (("batch", batch), ("verify_batch", verify_batch)):
            if type(value) is not int or not 0 <= value <= MAX_SLOTS:
                raise ProtocolError(f"warm: {name} {str(value)[:20]} must be 0..{MAX_SLOTS}")
        static = self.executor.static
        cache = compile_cache.current()
        what = {"model": self.spec.model, "layers": [self.spec.start, self.spec.end],
                "dtype": self.spec.dtype, "rows": sorted(set(rows)), "batch": batch,
                "verify_batch": verify_batch, "fused": bool(self.fused),
                "kv_buckets": list(static.buckets) if static is not None else []}
        entry = cache.lookup(what) if cache is not None else None
        if entry is not None:
            log.info("shard %d: warming up from the compile cache (%s; its first warm-up took "
                     "%.0f s)", self.index, cache.entry_path(what).name, entry["seconds"])
        elif cache is not None and static is not None and static.capture:
            log.info("shard %d: no compile cache entry for these steps yet: this warm-up "
                     "compiles and autotunes (minutes on a large model), once per machine",
                     self.index)
        t0 = time.perf_counter()
        graphs, seconds = 0, 0.0  # (the captures')
        if static is not None:
            rows = [n for n in rows if n <= MAX_VERIFY_ROWS]
            slots = self.executor.kv.slots
            graphs, seconds = static.warm(
                rows, min(batch, slots), label=f"shard {self.index}: ",
                verify_batch=min(verify_batch, slots) if self.executor.batch_verify else 0,
                max_rows=self.max_step, estimate_s=entry["seconds"] if entry else None)
            log.info("shard %d: %d step graphs captured in %.1f s", self.index, graphs,
                     seconds)
        if self.fused:  # the eager steps' kernel too (`shards.fused.warm_prefill`)
            warm_prefill(self.model)
        hybrid_prewarm.finish(self.prewarm)  # (a hybrid's prefill kernels compiled ahead)
        self.prewarm = None
        state = "off" if cache is None else "reused" if entry is not None else "written"
        if cache is not None and entry is None:
            cache.record(what, time.perf_counter() - t0, graphs)
        self._reply(route, message("ok", sid=msg["sid"],
                                   info={"graphs": graphs, "seconds": seconds,
                                         "compile_cache": state}))

    def _on_warm_prefill(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Capture every bucket of the eager prefill steps' graphs (`shards.prefill_graphs`),
        before any request: serve asks for it before ready (a `generate` captures a bucket on its
        first use instead: its one prompt takes one or two). None to capture on a CPU shard,
        a range the pieces do not serve, or in deterministic mode (its steps never take them)."""
        if self.executor is None:
            raise ProtocolError("warm_prefill before configure")
        pieces, built, took = self.executor.prefill_graphs, 0, 0.0
        if pieces is not None and not self.executor.deterministic:
            built, took = pieces.warm(self.max_step)
            log.info("shard %d: prefill graphs of %d row buckets captured in %.2f s",
                     self.index, built, took)
        self._reply(route, message("ok", sid=msg["sid"],
                                   info={"buckets": built, "seconds": took}))

    def _drop_socket(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        try:
            self.poller.unregister(sock)
        except KeyError:  # the link failed before it was registered
            pass
        sock.close(0)

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.feed, self.feed_kind = None, "none"
        if self.proposals is not None:
            self.proposals.close()
        self.proposals = None
        self._drop_socket(self.feed_sock)
        self.feed_sock = None

    def _close_links(self) -> None:
        for t in (self.out, self.inbox, self.board):
            if t is not None:
                t.close()
        self.out = self.inbox = self.board = None
        self._close_feed()
        self._drop_socket(self.down)
        self.down = None
        self.transport_kind = "none"
