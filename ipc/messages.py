"""Every message that crosses a process boundary, and the one codec for them (msgpack).

A message is a msgpack map with `type` and `v` (protocol version), sent as the first frame of a
zmq multipart message; tensor bytes, when any, follow as raw out-of-band frames. zmq delivers a
multipart message whole or not at all, so a rejected message is always consumed entirely: the
channel is never left half-read. No pickle anywhere.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import msgpack

PROTOCOL_VERSION = 22  # 2: speculative decoding; 3: batched steps (several sequences per step);
# 4: cuda-ipc slots ordered by IPC events (a v3 sender would not wait on the receiver's);
# 5: token-tree verify steps (segment `tree`, `kept`; outcome `path`; propose `tree`,
# `kept`; proposal `parents`), proposals prepared from the verdict (segment `then`, feat `next`);
# 6: proposals handed by the draft to the first shard (segment `ask`, outcome `asked`,
# `drafted`, `draft_gone`, draft_configure `push`); 7: `verdict` (was feat `next`), sent after
# the step's rows, which go before the verdict is known; 8: cache tensors streamed over the
# channel (snap_save / snap_load `stream`, saved `names` + frames) for shards without the file;
# logprobs and logits processors (sample `lp`, `bias`, `rep`, `mask`; segment `plp`; outcome
# `lp`, `plp`); 9: a grammar's mask sent after its step (sample `late_mask`, message `mask`);
# 10: paged KV (configure `kv_block`, `kv_blocks`; segment, snap_restore and snap_load `blocks`;
# segment `copy`); 11: sampled proposals with their distributions (draft_begin `sample`;
# proposal, drafted and segment `q`: `shards.spec_sampling`); 12: the host tier of live KV
# (configure `kv_host_blocks`, message `kv_swap`: swap preemption, `runtime.batching`); 13: the
# host pool shared with the RAM tier (`runtime.host_pool`): kv_swap "drop" gives back the host
# blocks of a sequence that ended while swapped out (a shard holds them only while used); 14:
# configure's `deterministic` (verify rows through the one-row step), reported in the info;
# 15: `warm` (the step graphs captured at start, `capture_at_start`), answered by `warmed`;
# 16: `warm` answered by `ok` (`warmed` gone: a v15 peer would fail or wait out the start);
# 17: decode lookahead (segment `prev`: its token is the one step `prev` sampled for its slot,
# taken on the device by a shard that is first and last, `shards.decode_ahead`); 18: lookahead
# on a split runtime (configure `board`: True asks the last shard for a token board, whose
# description its info's `board` carries and the first shard's configure passes on,
# `ipc.token_board`; the first shard's info `board` says whether it mapped it; message `void`);
# 19: the token board's host-mode token words carry their step (`ipc.token_board.pack`); warm's
# optional `verify_batch` (batched verify steps); 20: `draft_warm` (draft_configure answers
# before the draft's warm-up); 21: `draft_gap` (context rows that never come); 22:
# `warm_prefill` (the prefill steps' graphs, `shards.prefill_graphs`)
MAX_HEADER_BYTES = 1 << 20  # a control header is small; anything larger is refused
MAX_FRAMES = 4

NoneType = type(None)
Num = (int, float)

# type -> {field: allowed python types}. Fields not listed are ignored (forward compatible);
# listed fields are required and type-checked.
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # authentication (any peer -> shard, shard -> peer)
    "hello": {"nonce": (bytes,), "role": (str,)},
    "challenge": {"nonce": (bytes,)},
    "auth": {"mac": (bytes,)},
    "welcome": {"index": (int,), "layers": (list,), "device": (str,), "pid": (int,),
                "host": (str,)},
    # coordinator -> shard setup
    # `kv_block` tokens per KV block, `kv_blocks` blocks in each shard's pool (the same number
    # on every shard: block ids are global, `runtime.block_manager`)
    "configure": {"session": (bytes,), "next": (dict, NoneType), "max_context": (int,),
                  "max_step_tokens": (int,), "slots": (int,), "transport": (str,),
                  "kv_block": (int,), "kv_blocks": (int,)},
    "configured": {"info": (dict,)},
    # coordinator -> first shard: step `sid` failed on its way, so the lookahead step that takes
    # its tokens fails at once (`ipc.token_board`)
    "void": {"sid": (int,)},
    # upstream shard -> downstream shard: set up the activation transport of this edge
    "link": {"transport": (str,), "host": (str,), "device": (str,), "dtype": (str,),
             "hidden": (int,), "max_step_tokens": (int,)},
    "linked": {"transport": (str,), "ring": (dict, NoneType)},
    # data plane: a step carries one segment per sequence (`seqs`, SEGMENT below); its tensor
    # holds the segments' rows one after the other. The result has one `outs` entry (OUTCOME)
    # per segment, and the logits rows of the segments that asked for them.
    # (optional `park: true`: a plain decode step whose feature rows the shards keep until a
    # step that is not parked or an `unpark`, `shards.parked_rows`)
    "step": {"sid": (int,), "seqs": (list,), "act": (dict, NoneType)},
    "result": {"sid": (int,), "outs": (list,), "act": (dict, NoneType)},
    "sample": {"sid": (int,), "position": (int,), "sample": (dict,)},
    # coordinator -> last shard: the grammar mask of segment `seg` of step `sid` (its sample
    # said `late_mask`), computed while the step ran (`shards.sampling`); None: no constraint
    "mask": {"sid": (int,), "seg": (int,), "mask": (bytes, NoneType)},
    # prefix cache (coordinator -> shard; `ok` / `saved` back)
    "snap_take": {"entry": (int,), "slot": (int,), "start": (int,), "end": (int,)},
    # `blocks` (snap_restore, snap_load): the slot's block table entries, as a segment's
    "snap_restore": {"entries": (list,), "slot": (int,), "blocks": (dict, NoneType)},
    "snap_drop": {"entries": (list,)},
    # `stream`: the shard cannot reach the cache file (another host, or a filesystem of its
    # own): a save sends its tensors back as `saved`'s frames, one per `names` entry, for the
    # coordinator to write; a load gets them as frames, one per item, read by the coordinator
    "snap_save": {"entry": (int,), "path": (str,), "items": (list,), "stream": (bool,)},
    "snap_load": {"path": (str,), "slot": (int,), "items": (list,), "stream": (bool,),
                  "blocks": (dict, NoneType)},
    # swap preemption (coordinator -> shard; `ok` back once copied): a preempted sequence's
    # blocks to the shard's host KV pool (`direction` "out") or back ("in"), `pairs` of
    # [device block, host block], or gives them back ("drop", pairs of [-1, host block]);
    # configure's optional `kv_host_blocks` sizes that pool
    "kv_swap": {"direction": (str,), "pairs": (list,)},
    "ok": {"info": (dict,)},
    # capture every step graph a request may replay (`StaticDecoder.warm`): steps of each of
    # `rows` rows, batched steps up to `batch` sequences, every KV-length bucket; the `ok`
    # says what it took ({graphs, seconds})
    # (optional `verify_batch`: batched verify steps of up to that many sequences)
    "warm": {"sid": (int,), "rows": (list,), "batch": (int,)},
    # capture every bucket of the eager prefill steps' graphs (`shards.prefill_graphs`): serve's
    # warm-up, so that no request pays a capture; the `ok` says {buckets, seconds}
    "warm_prefill": {"sid": (int,)},
    # (optional `copy_wait_s`: how long the save waited for its snapshot's host copy)
    "saved": {"entry": (int,), "path": (str,), "checksums": (dict, NoneType),
              "error": (str, NoneType), "names": (list,)},
    # speculative decoding: coordinator -> draft process
    # (the draft keeps `slots` contexts, one per sequence that feeds it: `slot` names one)
    "draft_configure": {"session": (bytes,), "max_context": (int,), "max_rows": (int,),
                        "feeders": (list,), "cache_dir": (str, NoneType), "spin_ms": Num,
                        "slots": (int,), "push": (bool,)},
    # the start's last word to the draft: answered once its warm-up (begun as the feeders
    # link) is done, an error if it failed
    "draft_warm": {},
    # a new sequence in `slot`: forget the context of the slot's last one. `sample`: the
    # sequence's sampling ({temperature, top_k, top_p, seed}) when the draft is to sample its
    # proposals from its own distribution and send it (`q`); None: its best guesses, no `q`
    "draft_begin": {"sid": (int,), "slot": (int,), "sample": (dict, NoneType)},
    # the context rows [start, end) of `slot`'s sequence never come (its plain steps there sent
    # none, `runtime.speculative.DraftClient.taps`): no proposal reads them
    "draft_gap": {"sid": (int,), "slot": (int,), "start": (int,), "end": (int,)},
    # `tree`: at most this many draft tokens as a tree (where the draft has a tree shape; n
    # bounds its depth), 0: a chain of n; `kept`: the tree rows the last verify step kept
    "propose": {"sid": (int,), "slot": (int,), "pos": (int,), "n": (int,), "token": (int,),
                "start": (int,), "sync": (int,), "tree": (int,), "kept": (list, NoneType)},
    # `q`: a sampled proposal's distributions, one entry per row (`shards.spec_sampling`)
    "proposal": {"sid": (int,), "tokens": (list,), "parents": (list, NoneType),
                 "q": (list, NoneType)},
    "draft_features": {"sid": (int,), "slot": (int,), "start": (int,), "end": (int,),
                       "sync": (int,)},
    "features": {"sid": (int,), "act": (dict,)},
    # draft process -> first shard (when `push` was configured: the first feeder is the first
    # shard): the proposal prepared from the verdict of step `after` for context `feat`, under
    # its key [pos, token, n, tree, kept]; `tokens` None with `error` when it could not be
    # prepared. The first shard holds a step whose segment `ask`s for it until it comes.
    "drafted": {"feat": (int,), "after": (int,), "key": (list,), "tokens": (list, NoneType),
                "parents": (list, NoneType), "q": (list, NoneType), "error": (str, NoneType),
                "compute_s": Num},
    # coordinator -> first shard: the draft process is gone; steps waiting for its proposals
    # run without them
    "draft_gone": {},
    # coordinator -> each shard: send the draft every feature row parked (a step's `park`,
    # `shards.parked_rows`); `ok` once they are on their way
    "unpark": {},
    # shard -> draft process: set up a feature link, then feature rows of tapped layers
    # (the first shard's `feed` also carries `proposals`: the description of a shared-memory
    # ring it offers for the `drafted` messages it is handed; optional, zmq without)
    "feed": {"transport": (str,), "host": (str,), "device": (str,), "dtype": (str,),
             "layers": (list,), "width": (int,), "max_rows": (int,)},
    # a feeder's rows of a step for draft context `slot` (`last`: the step's last piece)
    "feat": {"sid": (int,), "slot": (int,), "pos": (int,), "n": (int,), "layers": (list,),
             "last": (bool,), "act": (dict, NoneType)},
    # after a verify step's rows, from the last shard: `next`, the proposal that will be asked
    # for next ({pos, token, kept, n, tree, push}), which the draft prepares meanwhile. The
    # rows go first, as soon as the step is launched: the draft takes them while the verdict
    # is worked out, and starts the proposal as soon as the verdict comes
    "verdict": {"sid": (int,), "slot": (int,), "next": (dict,)},
    # supervision and errors
    "wake": {},  # doorbell: a message waits in a shared-memory ring
    "ping": {},
    "pong": {"busy": (bool,)},
    "error": {"message": (str,), "code": (str,)},
    "shutdown": {},
    "bye": {},
}
# one sequence's part of a step. `draft`: the draft tokens of a verify segment (its tokens after
# the first), else None; `feat`: the sequence's context in the draft process, to which shards
# that tap layers send those layers' rows (None: the sequence does not feed the draft);
# `tree`: a verify segment's token tree, its draft rows' parents (None: a chain); `kept`: the
# rows the sequence's last verify step kept of its tree, which every shard moves to their
# positions before this segment runs (`shards.spec_tree.kept_moves`; None: nothing to move);
# `then`: {n, tree}, the proposal the sequence will ask for after this verify step, which the
# last shard passes to the draft with the verdict (`verdict`'s `next`) so it is ready sooner;
# `ask`: {n, tree, after}, a decode segment (one row, its last token) whose draft tokens the
# draft process hands the first shard (`drafted`, prepared from step `after`'s verdict); the
# first shard makes it a verify segment with them, or leaves it a decode segment and says why
# (`asked`: {draft, tree, missed, waited, compute}), and passes it on with `ask` None
SEGMENT: dict[str, tuple[type, ...]] = {
    "slot": (int,), "pos": (int,), "n": (int,), "sample": (dict, NoneType), "logits": (bool,),
    "draft": (list, NoneType), "feat": (int, NoneType), "tree": (list, NoneType),
    "kept": (list, NoneType), "then": (dict, NoneType), "ask": (dict, NoneType),
    "asked": (dict, NoneType), "plp": (dict, NoneType), "blocks": (dict, NoneType),
    "copy": (list, NoneType), "q": (list, NoneType), "prev": (int, NoneType)}
# `blocks`: None, or {at, ids}: before the segment runs, entries [at, at + len(ids)) of its slot's
# block table become `ids` and the table ends there (at = 0: a new sequence's table); the table
# travels with the step, so each shard has it before the step reaches it. `copy`: None, or
# [[src, dst], ...]: blocks copied (in every layer) before the segment runs (copy on write of a
# forked sequence's last shared block, `runtime.block_manager.BlockManager.fork`)
# `q`: a verify segment whose draft tokens were sampled: per row, the distribution its first
# children were drawn from (`shards.spec_sampling`: packed ids and probabilities, or None);
# None: the draft tokens are the draft's fixed guesses (kept when they match the target's draw)
# `prev`: None, or the sid of the step whose sampled token is this one-row segment's input (a
# lookahead step, sent before that token is known; its token id in the tensor is a placeholder)
# `plp`: {targets, k, temperature}: the logprobs of a prompt chunk's next tokens (`targets`: the
# token after each of its first len(targets) rows), for a request that echoes its prompt with
# logprobs; the sample dict's optional fields (`lp`, `bias`, `rep`, `mask`) are described in
# `shards.sampling`
# one segment's outcome. `token`: sampled for the position after the last accepted row (None
# when the segment was not sampled); `accepted`: draft tokens a verify segment kept; `path`:
# their rows, for a tree verify segment (else None); `asked`: the segment's `asked` (what the
# first shard made of its `ask`), else None; `lp`: with the sample's `lp`, one
# `shards.sampling.logprob_entries` entry per token the segment emitted (kept draft tokens,
# then `token`), else None; `plp`: the entries of the segment's `plp` targets, else None
OUTCOME: dict[str, tuple[type, ...]] = {"token": (int, NoneType), "accepted": (int,),
                                        "logits": (bool,), "path": (list, NoneType),
                                        "asked": (dict, NoneType), "lp": (list, NoneType),
                                        "plp": (list, NoneType)}
MAX_SEGMENTS = 512  # sequences in one step (a ring slot's header holds this many)
NESTED = {"step": ("seqs", SEGMENT), "result": ("outs", OUTCOME)}

# how many payload frames follow the header, by type (None: checked by the handler)
PAYLOAD_FRAMES: dict[str, int | None] = {"step": None, "result": None, "sample": 1,
                                         "propose": None, "feat": None, "features": 1}
# streamed prefix-cache tensors: one frame per tensor the header names
CACHE_FRAMES = {"saved": lambda m: len(m["names"]),
                "snap_load": lambda m: len(m["items"]) if m["stream"] else 0}
MAX_CACHE_FRAMES = 8192


class ProtocolError(ValueError):
    """A frame that is not a valid message; `code` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_message") -> None:
        super().__init__(message)
        self.code = code
        self.sid: int | None = None


def optional_seconds(msg: dict[str, Any], name: str) -> float:
    """An optional duration field of `msg` (0 where absent); ProtocolError naming it where it is
    not a finite, non-negative float."""
    v = msg.get(name, 0.0)
    if type(v) is not float or not 0.0 <= v < math.inf:
        raise ProtocolError(f"{msg.get('type')}: {name} must be a duration in seconds, got {v!r}")
    return v


def message(type_: str, **fields: Any) -> dict[str, Any]:
    if type_ not in SCHEMAS:
        raise ValueError(f"unknown message type {type_!r}")
    return {"type": type_, "v": PROTOCOL_VERSION, **fields}


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def encoder() -> Callable[[dict[str, Any]], bytes]:
    """`encode` as a packer kept by its caller (a ring sender's hot path: no packer made per
    message); one per thread."""
    return msgpack.Packer(use_bin_type=True).pack


def decode(frame: bytes | memoryview, payload_frames: int = 0) -> dict[str, Any]:
    """Parse and validate one header frame; raise ProtocolError naming what is wrong."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}", "oversized")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)  # (no copy of a ring's)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack ({type(e).__name__}: {e})", "malformed")
    if not isinstance(msg, dict):
        raise ProtocolError(f"header is a {type(msg).__name__}, expected a map", "malformed")
    t = msg.get("type")
    if not isinstance(t, str) or t not in SCHEMAS:  # (a list or map is not even hashable)
        raise ProtocolError(f"unknown message type {t!r}", "unknown_type")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{t}: protocol version {msg.get('v')!r}, this side speaks {PROTOCOL_VERSION}",
            "version",
        )
    fields, nested = _CHECKS[t]
    if not fields.valid(msg):
        fields.walk(msg, t)
    if nested is not None:
        field, each = nested
        items = msg[field]
        if not 1 <= len(items) <= MAX_SEGMENTS:
            raise ProtocolError(f"{t}: {field} must hold 1..{MAX_SEGMENTS} entries, "
                                f"got {len(items)}")
        for i, item in enumerate(items):
            if not each.valid(item):
                if not isinstance(item, dict):
                    raise ProtocolError(f"{t}: {field}[{i}] is a {type(item).__name__}, "
                                        "expected a map")
                each.walk(item, f"{t}: {field}[{i}]")
    if t in CACHE_FRAMES:  # one frame per tensor a streamed cache message names
        expected = CACHE_FRAMES[t](msg)
        if payload_frames != expected or expected > MAX_CACHE_FRAMES:
            raise ProtocolError(f"{t}: expected {expected} payload frames (at most "
                                f"{MAX_CACHE_FRAMES}), got {payload_frames}")
        return msg
    expected = PAYLOAD_FRAMES.get(t, 0)
    if expected is not None and payload_frames != expected:
        raise ProtocolError(f"{t}: expected {expected} payload frames, got {payload_frames}")
    if payload_frames > MAX_FRAMES:
        raise ProtocolError(f"{t}: {payload_frames} payload frames is too many")
    return msg


class _Signatures:
    """The fields check of one schema, and the exact type signatures (the type of each field's
    value, in schema order) of maps it found valid before. A map of a known signature is valid
    without the field-by-field walk: its signature is made in C (`itemgetter`, `map(type,
    ...)`), and one set lookup checks it. Steps and results repeat a few signatures every hop."""

    MAX = 256  # (signatures kept per schema; a peer cycling through more only pays the walk)

    def __init__(self, schema: dict[str, tuple[type, ...]]) -> None:
        self.schema = schema
        fields = tuple(schema)
        # (itemgetter of one field returns the value, not a 1-tuple)
        self.get = operator.itemgetter(*fields) if len(fields) > 1 else None
        self.known: set[tuple[type, ...]] = set()

    def valid(self, msg: Any) -> bool:
        """Whether `msg` is a map of a signature found valid before (False: walk it)."""
        get = self.get
        if get is None or type(msg) is not dict:
            return False
        try:
            return tuple(map(type, get(msg))) in self.known
        except KeyError:  # (a field missing: the walk names it)
            return False

    def walk(self, msg: dict[str, Any], where: str) -> None:
        """Raise ProtocolError naming the first field of `msg` that is missing or of a type
        the schema does not allow (`where`: the message's name in it); remember the signature
        of a valid one."""
        _walk_fields(msg, self.schema, where)
        if self.get is not None and type(msg) is dict and len(self.known) < self.MAX:
            self.known.add(tuple(map(type, self.get(msg))))


def _checks(t: str) -> tuple[_Signatures, tuple[str, _Signatures] | None]:
    nested = NESTED.get(t)
    return _Signatures(SCHEMAS[t]), None if nested is None else (nested[0],
                                                                 _Signatures(nested[1]))


# message type -> (the check of its fields, (the nested field, the check of each of its maps))
_CHECKS = {t: _checks(t) for t in SCHEMAS}


def _walk_fields(msg: dict[str, Any], schema: dict[str, tuple[type, ...]], where: str) -> None:
    for field, types in schema.items():
        if field not in msg:
            raise ProtocolError(f"{where}: field {field!r} is missing")
        value = msg[field]
        if type(value) in types:  # (the common case, on every hop: a type the schema names)
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = "/".join(x.__name__ for x in types)
            raise ProtocolError(f"{where}: field {field!r} must be {names}, "
                                f"got {type(value).__name__}")


def segment(slot: int, pos: int, n: int, sample: dict | None = None, logits: bool = False,
            draft: list[int] | None = None, feat: int | None = None,
            tree: list[int] | None = None, kept: list[int] | None = None,
            then: dict | None = None, ask: dict | None = None,
            plp: dict | None = None, blocks: dict | None = None,
            copy: list | None = None, q: list | None = None,
            prev: int | None = None) -> dict[str, Any]:
    """One sequence's part of a step (SEGMENT)."""
    return {"slot": slot, "pos": pos, "n": n, "sample": sample, "logits": logits,
            "draft": draft, "feat": feat, "tree": tree, "kept": kept, "then": then, "ask": ask,
            "asked": None, "plp": plp, "blocks": blocks, "copy": copy, "q": q, "prev": prev}


def best_effort_sid(frame: bytes | memoryview) -> int | None:
    """The `sid` of a rejected message, if it can be read at all (so its sender can match the
    error to the operation it belongs to)."""
    try:
        msg = msgpack.unpackb(bytes(frame[:MAX_HEADER_BYTES]), raw=False)
    except Exception:  # noqa: BLE001 - unreadable: no sid
        return None
    sid = msg.get("sid") if isinstance(msg, dict) else None
    return sid if isinstance(sid, int) and not isinstance(sid, bool) else None


def error(message_: str, code: str = "error", **extra: Any) -> dict[str, Any]:
    return message("error", message=message_, code=code, **extra)
