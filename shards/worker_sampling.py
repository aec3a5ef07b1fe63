"""The last shard's sampling: a step's tokens drawn from its logits (greedy, sampled, or a
verify step's accepted draft tokens), its late grammar masks awaited, its result sent to the
coordinator and its verdicts to the draft; and the sample of stored logits (an exact
prefix-cache hit).

`LastShardSampling` is one part of `shards.worker.ShardServer`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from layersplit.ipc.messages import ProtocolError, message
from layersplit.ipc.transport import tensor_from
from layersplit.shards.accept import accept_draft
from layersplit.shards.decode_ahead import deferrable
from layersplit.shards.executor import Segment
from layersplit.shards.finite import bad_segments, greedy_draw, mark_rows, nonfinite_error
from layersplit.shards.sampling import (
    SamplingParams,
    check_mask,
    check_processors,
    has_processors,
    is_greedy,
    logprob_entries,
    process_logits,
    sample_rows,
    sample_tokens,
)
from layersplit.shards.spec_tree import rows_to_move

log = logging.getLogger("layersplit.shard")


class LastShardSampling:
    """What only the last shard does with a step's rows once they ran."""

    def _on_mask(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """A grammar mask computed while its step ran: the step samples once it has all."""
        if not self.model.is_last:
            raise ProtocolError("mask: only the last shard samples", "unexpected")
        if msg["mask"] is not None:
            bad = check_mask(msg["mask"], self.cfg.vocab_size, "mask")
            if bad is not None:
                raise ProtocolError(f"mask of step {msg['sid']}: {bad}")
        self.late_masks[(msg["sid"], msg["seg"])] = msg["mask"]
        if self.awaiting is None or self.awaiting[0]["sid"] != msg["sid"]:
            return
        step, outs, fed, _ = self.awaiting
        if all((step["sid"], i) in self.late_masks for i, seg in enumerate(step["seqs"])
               if seg["sample"] is not None and seg["sample"].get("late_mask")):
            self.awaiting = None
            try:
                self._sample_step(step, outs, fed)
            except Exception as e:  # noqa: BLE001 - reported, the loop goes on
                self._step_failed(step, e)
            self._run_queued()

    def _sample_step(self, msg: dict[str, Any], outs: list[torch.Tensor],
                     fed: list[tuple[int, Segment]]) -> None:
        """The last shard's sampling of a step whose rows ran (`outs`, a tensor per segment;
        `fed`: the segments that feed the draft), its late masks in hand; the result goes to
        the coordinator, the verdicts to the draft."""
        sid = msg["sid"]
        seqs = []
        for i, seg in enumerate(msg["seqs"]):
            if seg["sample"] is not None and seg["sample"].get("late_mask"):
                sample = {k: v for k, v in seg["sample"].items() if k != "late_mask"}
                sample["mask"] = self.late_masks.pop((sid, i))
                seg = {**seg, "sample": sample}
            seqs.append(seg)
        msg = {**msg, "seqs": seqs}
        for key in [k for k in self.late_masks if k[0] <= sid]:  # (of steps that failed)
            del self.late_masks[key]
        if deferrable(msg["seqs"]):
            self._sample_on_device(msg, outs)
            return
        self.unsent.flush(wait=True)  # (results go in step order)
        results, logits_rows = [], []
        greedy = {}  # plain greedy segments: one argmax for all (one device sync)
        plain = [i for i, seg in enumerate(msg["seqs"]) if seg["draft"] is None and
                 seg["sample"] is not None and is_greedy(seg["sample"]["temperature"],
                                                         seg["sample"]["top_k"])
                 and seg["sample"].get("lp") is None and not has_processors(seg["sample"])]
        if len(plain) > 1:
            _, marked = greedy_draw(torch.stack([outs[i][-1] for i in plain]))
            greedy = dict(zip(plain, marked.tolist()))
        checked = []  # the rows each other draw came from, checked together below
        for i, (seg, out) in enumerate(zip(msg["seqs"], outs)):
            src = [len(out) - 1]  # the rows of the tokens it emits
            token, accepted, path, lp = None, 0, None, None
            if i in greedy:
                token = greedy[i]
            elif seg["sample"] is not None:
                token, accepted, path, src, lp = _sample_segment(seg, out)
                checked.append((i, out if seg["draft"] is not None else out[-1:]))
            plp = seg["plp"]
            if plp is not None:
                plp = logprob_entries(out[:len(plp["targets"])], plp["targets"],
                                      float(plp["temperature"]), plp["k"])
            results.append({"token": token, "accepted": accepted, "logits": seg["logits"],
                            "path": path, "asked": seg["asked"], "lp": lp, "plp": plp})
            if seg["logits"]:  # (a verify segment's: the row of each token it emitted)
                rows = out[src[0]:src[0] + 1] if len(src) == 1 else out[src]
                logits_rows.append((i, rows.float()))
        bad = [i for i in greedy if greedy[i] < 0]
        bad += [checked[j][0] for j in bad_segments([rows for _, rows in checked])]
        for i in bad:  # (that sequence fails; the step's others go on)
            results[i].update(token=None, accepted=0, path=None, lp=None,
                              error=self._nonfinite(msg["seqs"][i]))
        # a segment's logits rows: its outcome's accepted + 1 (a failed one's: its last)
        logits_rows = [rows if results[i]["accepted"] + 1 == len(rows) else rows[-1:]
                       for i, rows in logits_rows]
        # with the verdict, the draft prepares its next proposal (it has the rows already);
        # when it hands that to the first shard, the coordinator is off the decode path, and
        # the verdict goes first
        pushed = any(seg["then"] is not None and seg["then"].get("push") is True
                     for seg in msg["seqs"])
        result = (message("result", sid=msg["sid"], outs=results, act=None),
                  torch.cat(logits_rows).cpu() if logits_rows else None)
        if self.trace is not None:
            self.trace("sampled", msg["sid"])
            if not pushed:
                self.trace("sent", msg["sid"])
        if not pushed:
            self.out.send(*result)
        for i, s in fed:
            nxt = _next_proposal(msg["seqs"][i], results[i])
            if nxt is not None and self.feed is not None:
                self._to_draft(message("verdict", sid=msg["sid"], slot=s.feed, next=nxt))
        if pushed:
            if self.trace is not None:
                self.trace("sent", msg["sid"])
            self.out.send(*result)
        self.early.after_sampling(self.executor, msg["seqs"], results,  # `shards.early_moves`
                                  f"shard {self.index}")

    def _sample_on_device(self, msg: dict[str, Any], outs: list[torch.Tensor]) -> None:
        """Sample a step of plain decode segments (`shards.decode_ahead.deferrable`) without
        waiting for the device: the tokens stay there for a lookahead step (`TokenBoard`), and
        the result goes once they reach the host, after the next step's kernels are queued."""
        seqs = msg["seqs"]
        last = torch.stack([out[-1] for out in outs])
        if all(is_greedy(seg["sample"]["temperature"], seg["sample"]["top_k"]) for seg in seqs):
            tokens, marked = greedy_draw(last)
        else:
            tokens = torch.cat([sample_tokens(
                out[-1:], float(seg["sample"]["temperature"]), int(seg["sample"]["top_k"]),
                float(seg["sample"]["top_p"]), int(seg["sample"]["seed"]),
                [seg["pos"] + seg["n"]]) for seg, out in zip(seqs, outs)])
            marked = mark_rows(last, tokens)
        if self.board is not None:  # (the last shard's: the first shard takes them there)
            self.board.post([seg["slot"] for seg in seqs], tokens, msg["sid"])
        rows = [out[-1].float()[None] for seg, out in zip(seqs, outs) if seg["logits"]]
        self.unsent.flush(wait=True)  # the steps before this one: it is queued behind them

        def send(ids: list[int], logits: torch.Tensor | None) -> None:
            outcomes = [{"token": t, "accepted": 0, "logits": seg["logits"], "path": None,
                         "asked": seg["asked"], "lp": None, "plp": None}
                        for t, seg in zip(ids, seqs)]
            for out, seg in zip(outcomes, seqs):
                if out["token"] < 0:  # (-1: a non-finite row, `greedy_draw`, `mark_rows`)
                    out.update(token=None, error=self._nonfinite(seg))
            if self.trace is not None:
                self.trace("sampled", msg["sid"], ahead=True)  # (its tokens on the host now)
                self.trace("sent", msg["sid"])
            try:
                self.out.send(message("result", sid=msg["sid"], outs=outcomes, act=None), logits)
            except Exception as e:  # noqa: BLE001 - reported as the step's failure
                self._report(self._failure(msg, e))

        self.unsent.add(marked, torch.cat(rows) if rows else None, send)

    def _nonfinite(self, seg: dict[str, Any]) -> str:
        """Why a segment that drew from non-finite logits failed (its outcome's `error`)."""
        e = nonfinite_error(self.spec.dtype, [seg["pos"] + seg["n"]],
                            f"{self.spec.start}:{self.spec.end}")
        log.error("shard %d: %s", self.index, e)
        return f"shard {self.index}: {e}"

    def _on_sample(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Sample from logits the coordinator stored (an exact prefix hit) on this device."""
        if not self.model.is_last:
            raise ProtocolError("sample: only the last shard samples", "unexpected")
        logits = tensor_from(frames[0].buffer, {"dtype": "float32",
                                                "shape": [self.cfg.vocab_size]})
        s = msg["sample"]
        _check_sample(s, "sample", self.cfg.vocab_size)
        if s.get("late_mask"):
            raise ProtocolError("sample: a stored row's mask comes with it (late_mask)")
        row = logits.to(self.device)[None]
        out = {"token": None, "accepted": 0, "logits": False, "path": None, "asked": None,
               "lp": None, "plp": None}
        if bad_segments([row]):  # (stored rows are checked when stored: `cache_ops`)
            out["error"] = self._nonfinite({"pos": msg["position"], "n": 0})
        else:
            x = process_logits(row, s)
            out["token"] = sample_rows(x, float(s["temperature"]), int(s["top_k"]),
                                       float(s["top_p"]), int(s["seed"]), [msg["position"]])[0]
            if s.get("lp") is not None:
                out["lp"] = logprob_entries(x, [out["token"]], float(s["temperature"]), s["lp"])
        self._reply(route, message("result", sid=msg["sid"], outs=[out], act=None))


SAMPLE_FIELDS = {"temperature": (int, float), "top_k": (int,), "top_p": (int, float),
                 "seed": (int,)}


def _next_proposal(seg: dict[str, Any], result: dict[str, Any]) -> dict | None:
    """What the draft will be asked to propose after this verify segment (`verdict`'s `next`):
    the segment's `then` at the position after the kept tokens, after the target's token."""
    then = seg["then"]
    if then is None or seg["draft"] is None or result["token"] is None:
        return None
    return {"pos": seg["pos"] + result["accepted"] + 1, "token": result["token"],
            "kept": rows_to_move(result["path"]),
            "n": then["n"], "tree": then["tree"], "push": then.get("push") is True}


def _sample_segment(seg: dict[str, Any], out: torch.Tensor) -> tuple[
        int, int, list[int] | None, list[int], list | None]:
    """A sampled segment's outcome from its logits `out` (rows, V): the token, the draft tokens
    kept and their tree path, the indices of the rows the tokens it emitted came from (one row
    for a decode step; for a verify step keeping k draft tokens, k + 1: row 0, then each kept
    row), and the logprobs of the tokens it emitted (with the sample's `lp`; a verify segment's
    from its own rows, so they are exactly plain decoding's)."""
    sp = seg["sample"]
    temp, top_k, top_p, seed = (float(sp["temperature"]), int(sp["top_k"]),
                                float(sp["top_p"]), int(sp["seed"]))
    pos, n, k = seg["pos"], seg["n"], sp.get("lp")
    if seg["draft"] is not None:
        kept, token = accept_draft(out, seg["draft"], temp, top_k, top_p, seed, pos,
                                   seg["tree"], seg["q"])
        lp = None
        if k is not None:  # kept row j's token came from its parent row, `token` from the
            # last kept row
            parents = seg["tree"]
            src = [parents[j - 1] if parents is not None else j - 1 for j in kept]
            lp = logprob_entries(out[[*src, kept[-1] if kept else 0]],
                                 [seg["draft"][j - 1] for j in kept] + [token], temp, k)
        return token, len(kept), kept if seg["tree"] is not None else None, [0, *kept], lp
    x = process_logits(out[-1:], sp)
    token = sample_rows(x, temp, top_k, top_p, seed, [pos + n])[0]
    lp = None if k is None else logprob_entries(x, [token], temp, k)
    return token, 0, None, [len(out) - 1], lp


def _check_sample(sample: dict[str, Any], where: str, vocab: int) -> None:
    """A segment's sampling parameters, checked before any compute (their ranges as a request's
    are: `SamplingParams`; the optional fields `shards.sampling.check_processors`)."""
    for name, types in SAMPLE_FIELDS.items():
        v = sample.get(name)
        if not isinstance(v, types) or isinstance(v, bool):
            raise ProtocolError(f"{where}: sample field {name!r} must be a number, got {v!r}")
    try:
        SamplingParams(temperature=sample["temperature"], top_k=sample["top_k"],
                       top_p=sample["top_p"], seed=sample["seed"])
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None
    bad = check_processors(sample, vocab)
    if bad is not None:
        raise ProtocolError(f"{where}: sample {bad}")
