"""Invariant 2: speculative output equals plain output, with 1, 2 and 3 shards, over every CPU
transport, for a DFlash draft and a classic draft, greedy and sampled. Also: feature rows come
from the right shards for the right positions, a restored prefix keeps speculating, and a draft
that dies or sends garbage costs speculation, never tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import time

import numpy as np
import pytest
import torch
from layersplit.draft.dflash import load_dflash, save_dflash, write_random_dflash
from layersplit.draft.dflash_config import read_dflash_config
from layersplit.draft.measure import block_logits, greedy_labels, target_rows
from layersplit.ipc.messages import message
from layersplit.launch.draft_train import optimize
from layersplit.runtime import speculative
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.errors import DraftError
from layersplit.runtime.generate import Progress, collect
from layersplit.runtime.placement import PlacementError
from layersplit.runtime.reference import ReferenceEngine
from layersplit.runtime.replies import POLL_MS
from layersplit.runtime.shard_group import STOPPED_CHECK_S
from layersplit.runtime.spec_policy import PolicyKnobs, SpecPolicy, policy_sizes
from layersplit.runtime.speculative import SpecStats, verify_shape
from layersplit.runtime.supervisor import LocalProcess
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from tests.helpers import (
    assert_same_logits,
    assert_same_run,
    assert_speculated_equals,
    layersplit_shm,
    run_logged,
    run_speculated,
    shard_children,
    wait_gone,
)

CHUNK = 16
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)
TREE = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0], [2]]  # the fitted draft's token tree
TEXT = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n<|im_start|>assistant\nthe cat"


@pytest.fixture(scope="module")
def fitted(target, tmp_path_factory):
    """A DFlash draft fitted to the target's own continuations of the test prompts (greedy and
    sampled): its drafts are kept often, not always, so verify steps keep some draft tokens and
    reject others, and accepted positions' feature rows matter."""
    ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
    seqs = []
    for prompt in _prompts(ref.tokenizer):
        for params in (GREEDY, SAMPLED):
            seqs.append(prompt + ref.generate(prompt, params).tokens)
    model = load_layer_range(open_checkpoint(target), 0, 6)
    rows = target_rows(model, seqs, [0] * len(seqs), [1, 4], "cpu")
    feats, tokens, final = rows.batch(torch.arange(len(seqs)))
    feats = feats.clone()  # out of inference mode: it feeds a graph that is trained
    lengths = rows.lengths
    head, embed = model.lm_head.weight, model.embed_tokens.weight
    labels = greedy_labels(final, head)
    path = write_random_dflash(read_hf_config(target), tmp_path_factory.mktemp("fitted"),
                               layers=1, taps=[1, 4], block_size=4)
    cfg = read_dflash_config(path)
    draft = load_dflash(path, cfg, torch.float32, "cpu").train().requires_grad_(True)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    anchors = torch.stack([torch.randperm(int(n) - 4, generator=torch.Generator().manual_seed(i))
                           [:32] + 1 for i, n in enumerate(lengths)])
    want = labels[torch.arange(len(seqs))[:, None, None], anchors[:, :, None] + torch.arange(3)]
    for _ in range(150):
        logits = block_logits(draft, head, embed, feats, tokens, anchors, 4, cfg.mask_token_id)
        optimize(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   want.reshape(-1)), list(draft.parameters()),
                 opt)
    raw = json.loads((path / "config.json").read_text())
    raw["spec_tree"] = TREE  # verify steps are token trees (`spec_tree=0`: chains)
    return save_dflash(draft.eval(), raw, path, torch.float32)


@pytest.fixture(scope="module")
def near(target, tmp_path_factory):
    """A classic draft: the target with noise on its weights (it agrees often, not always)."""
    out = tmp_path_factory.mktemp("near") / "m"
    shutil.copytree(target, out)
    state = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def _cfg(target, n, draft, **kw):
    return RuntimeConfig(model=str(target), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, draft=str(draft), **kw)


def _prompts(tok):
    return [tok.encode(TEXT * 2), tok.encode("the cat sat")]


CASES = [(1, "auto"), (2, "shm"), (2, "zmq"), (3, "zmq")]
# The DFlash draft over every CPU transport (its feature rows travel over them too); the classic
# draft, fed tokens only, on 1, 2 and 3 shards (2 over zmq adds nothing to 3 over zmq for it, and
# nothing to the DFlash draft's 2 over zmq for the chain)
SPEC_CASES = [("dflash", n, t) for n, t in CASES] + [
    ("classic", n, t) for n, t in CASES if (n, t) != (2, "zmq")]


@pytest.fixture(scope="module")
def ref(target):
    return ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)


@pytest.fixture(scope="module")
def want(ref):
    """The reference's plain runs of the test prompts, greedy and sampled: tokens and the
    float32 logits of every position (`run_logged`)."""
    return {(i, params.temperature): run_logged(ref, prompt, params)
            for i, prompt in enumerate(_prompts(ref.tokenizer)) for params in (GREEDY, SAMPLED)}


def _compare(coord, want, prompts: int = 2) -> SpecStats:
    """Speculative outputs of every prompt, greedy and sampled, must equal the reference's
    plain runs, tokens and the logits of every accepted position bit for bit; the speculation
    statistics of all the speculative runs are returned."""
    total = SpecStats()
    for i, prompt in enumerate(_prompts(coord.tokenizer)[:prompts]):
        for params in (GREEDY, SAMPLED):
            total.merge(assert_speculated_equals(coord, prompt, params,
                                                 want[i, params.temperature],
                                                 f"prompt {i}, temperature {params.temperature}"))
    return total


@pytest.mark.slow
@pytest.mark.parametrize("kind,n,transport", SPEC_CASES,
                         ids=[f"{k}-{n}shard-{t}" for k, n, t in SPEC_CASES])
def test_speculative_equals_plain(target, fitted, near, want, kind, n, transport):
    before = layersplit_shm()
    draft = fitted if kind == "dflash" else near
    with Coordinator(_cfg(target, n, draft, transport=(transport,))) as coord:
        assert coord.draft_info["kind"] == kind
        stats = _compare(coord, want)
        # verify steps kept whole runs of draft tokens, and rejected others: both paths ran
        assert stats.acceptance_length > 1.3
        assert 0 < stats.accepted_at[0] < stats.proposed_at[0]
        assert 0 < stats.accepted_at[1] < stats.proposed_at[1]
        if kind == "dflash":  # token trees: some steps kept a branch off the first path
            assert stats.off_chain > 0
            # and proposals prepared from the verdicts were used (12-38 of 91 on 2 cores)
            assert stats.prepared > 0
        else:  # a classic draft is sent each committed token once, not the sequence each time
            prompts = _prompts(coord.tokenizer)
            assert 0 < stats.tokens_sent <= 2 * sum(len(p) + GREEDY.max_tokens for p in prompts)
        assert len(shard_children()) == n + 1
    assert shard_children() == []
    assert layersplit_shm() - before == set()


def _probing(policy: SpecPolicy) -> SpecPolicy:
    """A policy like `policy` whose off phases are 2 plain steps (a probe follows at once), and
    whose first look is 2 plain steps that send the draft no rows and 16 that do."""
    return SpecPolicy(policy.sizes, PolicyKnobs(off_steps=2, off_steps_max=2, refresh=2,
                                                lead=16), policy.spec_seqs)


@pytest.mark.slow
def test_measured_policy_mixes_rounds_and_plain_steps_output_the_reference(target, fitted,
                                                                             want):
    """`spec_policy = measured` (here on CPUs, where what it chooses depends on the machine's
    timings): requests run the policy's rounds and plain steps, mixed (a first look: plain
    steps to measure, then the whole tree; then its choice, and where it is off, probes: here
    after 2 plain steps, so that every request speculates), and the output of every request,
    greedy and sampled, is the reference's, tokens and logits; the decisions show in the
    request's statistics and its JSON. (What it chooses: tests/runtime/test_spec_policy.py.)"""
    with Coordinator(_cfg(target, 1, fitted, spec_policy="measured")) as coord:
        assert coord.policy_measures and coord.spec_policy.sizes == [7, 3, 1]
        coord.spec_policy = _probing(coord.spec_policy)
        assert coord.spec_sampling_mode() == "coupled"  # (auto: the policy decides)
        stats = _compare(coord, want)
        assert stats.verifies > 0 and stats.off_steps > 0 and 7 in stats.sizes
        policy = coord.spec_policy
        assert policy.choice(1, False) is not None and policy.choice(1, True) is not None
        assert policy.stats.rounds >= stats.verifies  # (a step planned ahead may not run)
        got = coord.generate(_prompts(coord.tokenizer)[0], GREEDY, use_cache=False).to_json()
        assert got["spec_rounds"] + got["spec_off_steps"] > 0
        assert got["spec_rounds"] == sum(got["spec_sizes"].values())
        assert set(got["spec_sizes"]) <= {"7", "3", "1"}


@pytest.mark.slow
def test_policy_plain_steps_decode_with_lookahead(target, dflash, want):
    """Under `spec_policy = measured` the plain steps a sequence runs between its rounds (to
    measure plain decoding, or with speculation off), though it still feeds the draft, are sent
    ahead as plain decoding's are (`runtime.batching`: lookahead); alone, then two in one batch
    (another batch size, decided apart; whether its plain steps come while both decode depends
    on the timings), the output is the reference's, tokens and logits. (An
    untrained draft: what the policy chooses on this loaded machine's timings is not checked
    here, but tests/runtime/test_spec_policy.py.)"""
    with Coordinator(_cfg(target, 1, dflash, spec_policy="measured", max_seqs=2,
                          spec_max_seqs=2)) as coord:
        assert coord.batcher.look_ahead
        coord.spec_policy = _probing(coord.spec_policy)
        prompts = _prompts(coord.tokenizer)
        rounds = off = 0
        for i in range(2):
            result, logits, spec = run_speculated(coord, prompts[i], GREEDY)
            assert_same_run((result, logits), want[i, GREEDY.temperature], f"prompt {i}")
            rounds, off = rounds + spec.verifies, off + spec.off_steps
        assert rounds >= 5 and off >= 4  # (its first look: plain steps, then rounds; probes)
        alone = coord.batcher.stats.ahead
        assert alone >= 2
        progress = [Progress(logits=[]) for _ in prompts]
        got = coord.generate_batch(prompts, [GREEDY] * 2, use_cache=False, progress=progress)
        for i, (r, pr) in enumerate(zip(got, progress)):
            assert_same_run((r, np.stack(pr.logits)), want[i, GREEDY.temperature],
                            f"batched prompt {i}")
        assert sum(pr.spec.verifies for pr in progress) > 0
        assert sum(pr.spec.off_steps for pr in progress) > 0
        assert coord.batcher.stats.widest == 2
        assert coord.spec_policy.choice(2, False) is not None  # (decided for 2 apart)


@pytest.mark.slow
def test_sampled_proposals_are_seeded_and_kept(target, fitted):
    """spec_sampling = rejection: the draft samples its proposals and sends their q; verify
    steps keep draft tokens by rejection sampling (the target's distribution: chi-square in
    tests/shards/test_spec_sampling.py). A seed fixes the output: the same tokens again
    (proposals prepared from verdicts equal asked ones: test_draft_channel.py)."""
    with Coordinator(_cfg(target, 2, fitted, spec_sampling="rejection")) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        progress = Progress()
        got = collect(coord.stream(prompt, SAMPLED, progress, use_cache=False), progress,
                      len(prompt))
        assert coord.generate(prompt, SAMPLED, use_cache=False).tokens == got.tokens
        assert progress.spec.prepared > 0
        # kept draft tokens, off the tree's first path too, over three seeds' answers (one
        # answer of 40 tokens may keep none off it)
        stats = [progress.spec]
        for seed in (8, 9):
            more = Progress()
            collect(coord.stream(prompt, dataclasses.replace(SAMPLED, seed=seed), more,
                                 use_cache=False), more, len(prompt))
            stats.append(more.spec)
        assert sum(s.accepted_at[0] for s in stats) > 0 and sum(s.off_chain for s in stats) > 0


@pytest.mark.slow
def test_sampled_requests_decode_plainly_with_spec_sampling_off(target, fitted, want,
                                                                tmp_path):
    """`spec_sampling = off` (what `auto` is for a DFlash draft where a GPU runs the target or
    the draft): a sampled request decodes plainly (no speculation statistics at all) and equals
    plain decoding (the reference's tokens and logits); a greedy one speculates all the same,
    also from a prefix a sampled request cached first (the sampled one still fed the draft, so
    the entry carries its rows)."""
    with Coordinator(_cfg(target, 2, fitted, spec_sampling="off",
                          kv_cache_dir=str(tmp_path))) as coord:
        assert coord.spec_sampling_mode() == "off"
        prompt = _prompts(coord.tokenizer)[1]
        for params, speculates in ((SAMPLED, False), (GREEDY, True)):
            progress = Progress(logits=[])
            got = collect(coord.stream(prompt, params, progress, use_cache=False), progress,
                          len(prompt))
            assert_same_run((got, np.stack(progress.logits)), want[1, params.temperature],
                            f"temperature {params.temperature}")
            if speculates:
                assert progress.spec is not None and progress.spec.verifies > 0
            else:
                assert progress.spec is None
        first = _prompts(coord.tokenizer)[0]
        assert coord.generate(first, SAMPLED).acceptance_length is None  # (caches `first`)
        hit = coord.generate(first, GREEDY)
        assert hit.cached_tokens > 0 and hit.acceptance_length is not None
        assert hit.tokens == coord.generate(first, GREEDY, use_cache=False,
                                            speculative=False).tokens


class TestOneDefaultChain:
    """Tests that leave a two-shard chain with the fitted draft, configured by default, as they
    found it (no process killed or stopped, the draft kept, nothing cached: `use_cache=False`)
    share one (`chain`): its start is most of a short test's time. Closed, and checked to leave
    no process behind, when the last of them is done (a class fixture: no other test of this
    module runs beside it)."""

    @pytest.fixture(scope="class")
    def chain(self, target, fitted):
        before = layersplit_shm()
        with Coordinator(_cfg(target, 2, fitted)) as coord:
            yield coord
        assert shard_children() == []
        assert layersplit_shm() - before == set()

    @pytest.mark.slow
    def test_deterministic_mode_reaches_the_shards_and_speculation_stays_plain(
            self, target, fitted, want, chain):
        """`deterministic = true` travels to every shard (verify rows one at a time through
        the plain decode step; on a GPU its captured graph:
        `tests/shards/test_executor_deterministic.py` on CPU, the speculation GPU tests on a
        GPU) and output equals plain decoding."""
        with Coordinator(_cfg(target, 2, fitted, deterministic=True)) as coord:
            assert [s["deterministic"] for s in coord.shard_info()] == [True, True]
            stats = _compare(coord, want, prompts=1)
            assert stats.acceptance_length > 1.3
        assert [s["deterministic"] for s in chain.shard_info()] == [False, False]

    @pytest.mark.slow
    def test_feature_rows_come_from_the_right_shards(self, target, chain):
        """The draft's rows are bit-equal to the reference's rows of the tapped layers (layer 1
        from shard 0, layer 4 from shard 1) at every committed position: prompt rows, and the
        rows of verify steps, kept draft tokens included."""
        ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
        prompt = _prompts(ref.tokenizer)[0]
        coord = chain
        assert [s.get("transport_out") for s in coord.shard_info()] == ["shm", "none"]
        out = coord.generate(prompt, GREEDY, use_cache=False)
        assert out.acceptance_length > 1.5  # rows of kept draft tokens are among them
        _assert_draft_rows(coord, target, ref, prompt, out.tokens)

    @pytest.mark.slow
    def test_parked_feature_rows_reach_the_draft(self, target, chain, want, monkeypatch):
        """While the policy has speculation off, plain decode steps park their feature rows
        on the shards (`shards.parked_rows`) instead of sending them each step: the probes'
        rounds still read every row (the output is the reference's, tokens and logits, bit for
        bit), and after `unpark` the draft's rows equal the reference's at every committed
        position, parked ones included (but the first look's, which send none)."""
        coord = chain
        was = coord.spec_policy
        # speculation never worth it (gain 100 x): a first look of 10 plain steps that send no
        # rows and 16 that do (15 of them parked, one run), then a probe every 10 plain steps
        coord.spec_policy = _policy_of(coord, gain=100.0, refresh=10, lead=16, off_steps=10,
                                       off_steps_max=10)
        gaps = _record_gaps(monkeypatch, coord)
        try:
            ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
            prompt = _prompts(ref.tokenizer)[1]
            parked = coord.batcher.stats.parked
            out, logits, spec = run_speculated(coord, prompt, GREEDY)
            assert_same_run((out, logits), want[1, GREEDY.temperature], "parked")
            assert spec.verifies > 0 and spec.off_steps >= 12, spec
            parked = coord.batcher.stats.parked - parked
            assert parked >= 8, parked  # (the plain steps but the last before each probe)
            coord.unpark()
            assert len(gaps) == 1, gaps  # (the first look's)
            committed = len(prompt) + len(out.tokens) - 1
            fed = [p for p in range(committed) if not gaps[0][0] <= p < gaps[0][1]]
            _assert_draft_rows(coord, target, ref, prompt, out.tokens, at=fed)
        finally:
            coord.spec_policy = was


    @pytest.mark.slow
    def test_plain_stretches_send_no_rows_and_the_draft_goes_on_after_them(
            self, target, chain, want, monkeypatch):
        """Plain decode steps more than `TAP_LEAD` steps before the policy's next round send
        the draft no feature rows (`DraftClient.taps`); the step that sends them again tells
        the draft which rows never came (`draft_gap`), and the probes' rounds read every other
        row: the output is the reference's, tokens and logits bit for bit, and the draft's
        rows outside the gaps equal the reference's."""
        coord = chain
        was = coord.spec_policy
        monkeypatch.setattr(speculative, "TAP_LEAD", 4)
        monkeypatch.setattr(speculative, "RESTART_ROWS", 3)
        # speculation never worth it: a first look of 9 plain steps that send no rows and 9
        # more, then a probe every 9 plain steps, the last 4 of each sending their rows
        coord.spec_policy = _policy_of(coord, gain=100.0, refresh=9, lead=7, off_steps=9,
                                       off_steps_max=9)
        gaps = _record_gaps(monkeypatch, coord)
        try:
            ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
            prompt = _prompts(ref.tokenizer)[1]
            out, logits, spec = run_speculated(coord, prompt, GREEDY)
            assert_same_run((out, logits), want[1, GREEDY.temperature], "untapped")
            assert spec.verifies > 0 and spec.untapped >= 8, spec
            assert spec.restarts == len(gaps) >= 2, (spec, gaps)
            assert all(len(prompt) <= a < b for a, b in gaps), gaps
            coord.unpark()
            committed = len(prompt) + len(out.tokens) - 1
            last = max(b for _, b in gaps)  # (steps after the last gap may not have sent theirs)
            fed = [p for p in range(last) if not any(a <= p < b for a, b in gaps)]
            _assert_draft_rows(coord, target, ref, prompt, out.tokens, at=fed)
            assert committed > last
        finally:
            coord.spec_policy = was

    @pytest.mark.slow
    def test_plain_steps_under_a_declining_policy_do_what_plain_decoding_does(
            self, chain, want, monkeypatch):
        """Where the policy decides every step plain (a first look that never ends), a step of a
        sequence with the draft loaded does what a plain decoding step does: it goes out ahead
        of its token (decode lookahead), it sends the draft no feature rows (none computed,
        none parked: `DraftClient.taps`), the draft process gets no request, whether it is
        stopped is read from /proc at most every STOPPED_CHECK_S and whether the processes live
        at most every POLL_MS, not at each step's wait; the output is the reference's, logits
        bit for bit."""
        coord = chain
        was = coord.spec_policy
        coord.spec_policy = _policy_of(coord, refresh=1 << 40)
        looks, asked, lives = [], [], []
        stopped, request, failure = LocalProcess.stopped, coord.draft_request, LocalProcess.failure
        monkeypatch.setattr(LocalProcess, "stopped", lambda p: looks.append(1) or stopped(p))
        monkeypatch.setattr(LocalProcess, "failure", lambda p: lives.append(1) or failure(p))
        monkeypatch.setattr(coord, "draft_request",
                            lambda msg, *a: asked.append(msg["type"]) or request(msg, *a))
        try:
            prompt = _prompts(coord.tokenizer)[1]
            stats = dataclasses.replace(coord.batcher.stats)
            t0 = time.monotonic()
            out, logits, spec = run_speculated(coord, prompt, GREEDY)
            elapsed = time.monotonic() - t0
            assert_same_run((out, logits), want[1, GREEDY.temperature], "declined")
            decode = GREEDY.max_tokens - 1  # (the first token is the prefill's)
            assert spec.verifies == 0 and spec.off_steps == decode, spec
            sent = coord.batcher.stats.steps - stats.steps
            ahead = coord.batcher.stats.ahead - stats.ahead
            parked = coord.batcher.stats.parked - stats.parked
            prefill = sent - decode - (coord.batcher.stats.ahead_dropped - stats.ahead_dropped)
            # every decode step but the first went out ahead of its token, none with rows
            assert ahead >= decode - 1 and spec.untapped == sent - prefill and parked == 0, \
                (sent, ahead, spec.untapped, parked)
            assert spec.restarts == 0
            assert asked == ["draft_begin"], asked
            assert len(looks) <= 1 + elapsed / STOPPED_CHECK_S, (len(looks), elapsed)
            assert len(lives) <= 3 * (1 + elapsed / (POLL_MS / 1000)), (len(lives), elapsed)
        finally:
            coord.spec_policy = was

    @pytest.mark.slow
    @pytest.mark.parametrize("n", [1, 2, 3])
    def test_proposals_handed_to_the_first_shard_equal_asked_ones(self, target, fitted, n,
                                                                  want, request):
        """The draft hands the proposals it prepares from verdicts to the first shard
        (`spec_push`, on by default where the first shard feeds it): the reference's tokens and
        logits, the same acceptance as when the coordinator asks for each, and most steps got
        theirs that way.
        (With two shards, the run that hands them over is the shared chain's: the default.)"""
        runs = {}
        for push in (True, False):
            cfg = _cfg(target, n, fitted, spec_push=push)
            shared = cfg == _cfg(target, 2, fitted)
            with (contextlib.nullcontext(request.getfixturevalue("chain")) if shared
                  else Coordinator(cfg)) as coord:
                assert coord.push_drafts is push
                prompt = _prompts(coord.tokenizer)[0]
                progress = Progress(logits=[])
                runs[push] = (collect(coord.stream(prompt, GREEDY, progress, use_cache=False),
                                      progress, len(prompt)), progress.spec)
                assert_same_run((runs[push][0], np.stack(progress.logits)),
                                want[0, GREEDY.temperature], f"spec_push {push}")
        (pushed, stats), (asked, _) = runs[True], runs[False]
        assert pushed.acceptance_length == asked.acceptance_length > 1.5
        # every verify step after the first of each run of them got its proposal from the draft
        assert stats.prepared >= stats.verifies - 3 > 0

    @pytest.mark.slow
    def test_logprobs_under_speculation_equal_plain(self, chain):
        """Logprobs of a speculated request come from its verify steps' rows (kept tokens from
        their parent rows in the token tree): equal to plain decoding's, greedy and sampled,
        bit for bit."""
        from layersplit.runtime.decoding import Decoding

        coord = chain
        prompt = _prompts(coord.tokenizer)[0]
        for params in (GREEDY, SAMPLED):
            got = {}
            for spec in (False, True):
                progress = Progress()
                req = coord.submit(prompt, params, progress, use_cache=False, speculative=spec,
                                   decoding=Decoding(logprobs=3))
                collect(coord.deltas(req), progress, len(prompt))
                assert (progress.spec is not None and progress.spec.verifies > 0) == spec
                got[spec] = progress
            plain, spec = got[False], got[True]
            assert spec.generated == plain.generated
            assert len(spec.logprobs) == len(plain.logprobs) >= len(plain.generated)
            for a, b in zip(spec.logprobs, plain.logprobs):
                assert a == b  # the token, its logprob and its top 3: the same float32 bits
            assert spec.spec.accepted_at[0] > 0  # kept draft tokens had their logprobs
        # a request with a logits processor runs plainly, even when asked to speculate
        progress = Progress()
        req = coord.submit(prompt, GREEDY, progress, use_cache=False, speculative=True,
                           decoding=Decoding(logit_bias=((5, 0.5),)))
        collect(coord.deltas(req), progress, len(prompt))
        assert progress.spec is None and len(progress.generated) == GREEDY.max_tokens
        # so does a grammar's: its output is the one asked not to speculate
        from layersplit.runtime.grammar import GrammarCompiler

        comp = GrammarCompiler(coord.tokenizer, coord.model_config.vocab_size, coord.eos_ids)
        schema = comp.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"], "additionalProperties": False})
        params = SamplingParams(max_tokens=12)
        outs = {}
        for spec in (True, False):
            progress = Progress()
            req = coord.submit(prompt, params, progress, use_cache=False, speculative=spec,
                               decoding=Decoding(grammar=lambda: comp.matcher(schema)))
            outs[spec] = collect(coord.deltas(req), progress, len(prompt)).text
            assert progress.spec is None
        assert outs[True] == outs[False] and outs[True].startswith('{"a":')


def _policy_of(coord, **knobs) -> SpecPolicy:
    """A policy of `coord`'s draft sizes (its verify shape's) with these `PolicyKnobs`."""
    block, tree = verify_shape(coord.draft_info, coord.config, coord.chunk)
    return SpecPolicy(policy_sizes(tree or block - 1), PolicyKnobs(**knobs),
                      coord.config.spec_max_seqs)


def _record_gaps(monkeypatch, coord) -> list[tuple[int, int]]:
    """The rows [start, end) each `draft_gap` the coordinator sends names, as it sends them."""
    gaps, request = [], coord.draft_request
    monkeypatch.setattr(coord, "draft_request", lambda msg, *a: (
        gaps.append((msg["start"], msg["end"])) if msg["type"] == "draft_gap" else None)
        or request(msg, *a))
    return gaps


def _assert_draft_rows(coord, target, ref, prompt: list[int], tokens: list[int],
                       at: list[int] | None = None) -> None:
    """The draft's rows of context 0 are bit-equal to the reference's rows of the tapped layers
    (1 and 4) at every committed position of `prompt` and its answer `tokens` (or those `at`):
    the prompt's as prefill chunks, the answer's one at a time, as decode steps."""
    committed = len(prompt) + len(tokens) - 1
    reply = coord.draft_request(message("draft_features", slot=0, start=0, end=committed,
                                        sync=coord.feat_sid(0)))
    rows = np.frombuffer(reply["_frames"][0].buffer, dtype=np.float32).reshape(committed, -1)
    seq = prompt + tokens[:-1]
    ex = RangeExecutor(load_layer_range(open_checkpoint(target), 0, 6), 256, taps=(1, 4))
    want = []
    for a, b in prefill_chunks(prompt, 0, len(prompt), CHUNK, ref.eos_ids):
        taps = {}
        ex.run(torch.tensor(prompt[a:b]), a, taps=taps)
        want.append(torch.cat([taps[1], taps[4]], dim=-1))
    for p in range(len(prompt), committed):  # decoded rows: one at a time, as decode steps
        taps = {}
        ex.run(torch.tensor([seq[p]]), p, taps=taps)
        want.append(torch.cat([taps[1], taps[4]], dim=-1))
    want = torch.cat(want).numpy()
    assert rows.shape == want.shape
    if at is not None:
        rows, want = rows[at], want[at]
    assert np.array_equal(rows, want)


@pytest.mark.slow
def test_random_dflash_draft_equals_plain(target, dflash, want):
    """An untrained draft: every draft token rejected, output still the target's."""
    with Coordinator(_cfg(target, 3, dflash)) as coord:
        stats = _compare(coord, want)
        assert stats.acceptance_length < 1.1


@pytest.mark.slow
def test_restored_prefix_keeps_speculating(target, fitted, ref, want, tmp_path):
    """RAM and disk hits (after a restart) restore the draft's feature rows with the KV: the
    rows are bit-equal, speculation goes on at once with the same acceptance, the output is
    unchanged (the reference's tokens and logits)."""
    cfg = _cfg(target, 2, fitted, kv_cache_dir=str(tmp_path))

    def rows(coord, n):
        reply = coord.draft_request(message("draft_features", slot=0, start=0, end=n,
                                            sync=coord.feat_sid(0)))
        return bytes(reply["_frames"][0].buffer)

    with Coordinator(cfg) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        n = len(prompt)
        cold = coord.generate(prompt, GREEDY)
        assert cold.acceptance_length > 1.5
        rows_cold = rows(coord, n)
        other = coord.tokenizer.encode("a different prompt " * 8)  # overwrites rows [0, n)
        coord.generate(other, GREEDY, use_cache=False)
        assert rows(coord, n) != rows_cold
        ram, logits, _ = run_speculated(coord, prompt, GREEDY, use_cache=True)
        assert_same_run((ram, logits), want[0, GREEDY.temperature], "RAM hit")
        assert ram.cache_tier == "ram" and ram.cached_tokens == n
        assert ram.tokens == cold.tokens and ram.acceptance_length == cold.acceptance_length
        assert rows(coord, n) == rows_cold
    with Coordinator(cfg) as coord:
        disk, logits, _ = run_speculated(coord, prompt, GREEDY, use_cache=True)
        assert_same_run((disk, logits), want[0, GREEDY.temperature], "disk hit")
        assert disk.cache_tier == "disk" and disk.cached_tokens == n
        assert disk.tokens == cold.tokens
        assert disk.acceptance_length == cold.acceptance_length  # speculation went on
        assert rows(coord, n) == rows_cold
        # a longer prompt sharing the prefix restores it and speculates over the rest
        longer = prompt + coord.tokenizer.encode(" and the dog")
        warm, logits, _ = run_speculated(coord, longer, GREEDY, use_cache=True)
        assert warm.cache_tier == "ram" and warm.cached_tokens > 0
        assert warm.acceptance_length is not None
        assert_same_run((warm, logits), run_logged(ref, longer, GREEDY), "longer")


@pytest.mark.slow
def test_a_prefix_without_feature_rows_gives_its_draft_context_back(target, fitted, want,
                                                                    tmp_path):
    """A request restoring a prefix cached without the draft's feature rows (here: by a run with
    no draft) cannot speculate nor feed the draft a whole context: it gives its context back
    before its prefill, so a request that comes while it decodes speculates (spec_max_seqs 1);
    both equal plain decoding."""
    with Coordinator(RuntimeConfig(model=str(target), devices=("cpu",) * 2,
                                   prefill_chunk=CHUNK, max_context=256, threads=1,
                                   draft="none", kv_cache_dir=str(tmp_path))) as plain_run:
        prompt = _prompts(plain_run.tokenizer)[0]
        plain_run.generate(prompt, GREEDY)  # (cached, with no feature rows)
    with Coordinator(_cfg(target, 2, fitted, kv_cache_dir=str(tmp_path),
                          spec_max_seqs=1)) as coord:
        other = _prompts(coord.tokenizer)[1]
        params = dataclasses.replace(GREEDY, max_tokens=40, ignore_eos=True)
        a_progress, b_progress = Progress(), Progress(logits=[])
        a = coord.deltas(coord.submit(prompt, params, a_progress))
        first = next(a)  # its prefill is done: it restored the prefix and gave the context back
        b = collect(coord.stream(other, GREEDY, b_progress, use_cache=False), b_progress,
                    len(other))
        assert first.token >= 0
        for _ in a:  # (its tokens: in its progress)
            pass
        assert b_progress.spec is not None and b_progress.spec.verifies > 0
        assert_same_run((b, np.stack(b_progress.logits)), want[1, GREEDY.temperature], "b")
        assert list(a_progress.generated) == coord.generate(prompt, params, use_cache=False,
                                                            speculative=False).tokens
        assert a_progress.cache_tier == "disk" and a_progress.cached_tokens == len(prompt)


# ---- faults ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_draft_killed_mid_request_generation_goes_on(target, near, ref):
    before = layersplit_shm()
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with Coordinator(_cfg(target, 2, near)) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        ref_run = run_logged(ref, prompt, params)
        want = ref_run[0].tokens
        progress = Progress(logits=[])
        stream = coord.stream(prompt, params, progress, use_cache=False)
        got = [d.token for _, d in zip(range(5), stream)]
        pid = coord._draft_proc.pid
        os.kill(pid, signal.SIGKILL)
        got += [d.token for d in stream if d.token >= 0]
        assert got == want
        assert_same_logits(np.stack(progress.logits), ref_run[1], "draft killed")
        assert coord.draft is None and "draft" in coord.draft_down
        assert wait_gone([pid]) == []
        again = coord.generate(prompt, params, use_cache=False)  # plain from now on
        assert again.tokens == want and again.acceptance_length is None
    assert shard_children() == []
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_dflash_draft_killed_while_the_first_shard_waits_for_its_proposal(target, fitted, ref):
    """The first shard holds a step for the draft's proposal when the draft dies: the step runs
    without it (the coordinator tells the shard), and the generation goes on, exact (the
    reference's tokens and logits)."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with Coordinator(_cfg(target, 2, fitted)) as coord:
        assert coord.push_drafts
        prompt = _prompts(coord.tokenizer)[0]
        ref_run = run_logged(ref, prompt, params)
        want = ref_run[0].tokens
        progress = Progress(logits=[])
        stream = coord.stream(prompt, params, progress, use_cache=False)
        got = [d.token for _, d in zip(range(12), stream)]
        assert progress.spec.prepared > 0  # steps are being held for proposals by now
        t0 = time.monotonic()
        os.kill(coord._draft_proc.pid, signal.SIGKILL)
        got += [d.token for d in stream if d.token >= 0]
        assert got == want
        assert_same_logits(np.stack(progress.logits), ref_run[1], "draft killed while held")
        assert time.monotonic() - t0 < 4.0  # not the shard's whole wait (DRAFT_WAIT_S)
        assert coord.draft is None and "draft" in coord.draft_down
        assert coord.generate(prompt, params, use_cache=False).tokens == want
    assert shard_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("required", [False, True])
def test_draft_lost_between_a_verdict_and_the_step_that_asks(target, fitted, want, required):
    """The coordinator loses the draft while a sequence is between a verdict and the step that
    asks for its proposal (or while that step is held): the step runs plain, the generation
    goes on exact (the reference's tokens and logits); with spec_required it fails, naming the
    draft."""
    with Coordinator(_cfg(target, 2, fitted, spec_required=required)) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        ref_run = want[0, GREEDY.temperature]
        progress = Progress(logits=[])
        stream = coord.stream(prompt, GREEDY, progress, use_cache=False)
        got = [d.token for _, d in zip(range(12), stream)]
        assert progress.spec.prepared > 0
        coord._lose_draft("lost by the test")
        if required:
            with pytest.raises(ShardFailure, match="draft"):
                for _ in stream:
                    pass
            return
        got += [d.token for d in stream if d.token >= 0]
        assert got == ref_run[0].tokens
        assert_same_logits(np.stack(progress.logits), ref_run[1], "draft lost")
        assert coord.generate(prompt, GREEDY, use_cache=False).tokens == ref_run[0].tokens


@pytest.mark.slow
def test_no_handing_over_when_the_last_shard_does_not_feed_the_draft(target, fitted, want):
    """The verdict comes from the last shard, after its rows: a last shard that taps no layer
    sends neither, so the coordinator asks for every proposal (and speculation pays as
    before; the output is the reference's, tokens and logits)."""
    with Coordinator(_cfg(target, 2, fitted, split=(5, 1))) as coord:
        assert not coord.push_drafts
        prompt = _prompts(coord.tokenizer)[0]
        got = assert_speculated_equals(coord, prompt, GREEDY, want[0, GREEDY.temperature])
        assert got.acceptance_length > 1.5


@pytest.mark.slow
def test_draft_killed_with_speculation_required_fails_clearly(target, near):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with Coordinator(_cfg(target, 2, near, spec_required=True)) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        stream = coord.stream(prompt, params, Progress(), use_cache=False)
        next(stream)
        os.kill(coord._draft_proc.pid, signal.SIGKILL)
        with pytest.raises(ShardFailure, match="draft"):
            for _ in stream:
                pass
    assert shard_children() == []


@pytest.mark.slow
def test_malformed_draft_frames_are_refused_without_desync(target, fitted, want):
    with Coordinator(_cfg(target, 2, fitted, transport=("zmq",))) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        first = assert_speculated_equals(coord, prompt, GREEDY, want[0, GREEDY.temperature])
        assert first.acceptance_length > 1.5
        # a propose with payload frames it cannot have, one with a missing field, garbage
        for frames, extra in (([b"\x01\x02\x03", b"x"], {}), ([], {"drop": "token"})):
            msg = message("propose", slot=0, pos=len(prompt), n=3, token=1, start=0, sync=0,
                          tree=0, kept=None)
            msg.pop(extra.get("drop", "-"), None)
            with pytest.raises(DraftError):
                coord.draft_request(msg, frames)
        coord.draft.sock.send(b"\xc1 not msgpack")
        again = assert_speculated_equals(coord, prompt, GREEDY, want[0, GREEDY.temperature])
        assert again.acceptance_length == first.acceptance_length
        assert coord.draft is not None


@pytest.mark.slow
def test_configuring_an_incompatible_draft_fails_before_serving(target, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(ShardFailure, match="vocab_size 300"):
        Coordinator(_cfg(target, 2, other)).start()
    assert shard_children() == []


@pytest.mark.slow
@pytest.mark.network
def test_bundled_draft_on_the_default_model(default_model, tmp_path):
    """The trained draft: lossless, real acceptance (a random draft commits 1.0 tokens per
    verify; this one 2.0 over this answer's first 16 tokens as a chain of 3 draft tokens, 1.74
    over 40), and the same acceptance after a restart restores the prompt from disk. (A short
    chain and a short answer: on CPUs a verify step runs its rows one by one, so each verify
    step costs `spec_block` decode steps; the draft's 31-node tree made this test take a
    minute, its 8-row block 35 s, and it rarely keeps more than 3 draft tokens here; 16 tokens
    are 8 verify steps that keep and reject draft tokens, all of them drafted from the prompt's
    feature rows that the restore must bring back.)"""
    cfg = RuntimeConfig(model=str(default_model), devices=("cpu", "cpu"), draft="default",
                        max_context=512, threads=1, kv_cache_dir=str(tmp_path), spec_tree=0,
                        spec_block=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with Coordinator(cfg) as coord:
        tok = coord.tokenizer
        prompt = tok.encode_chat([{"role": "user", "content":
                                   "What are the main causes of the French Revolution?"}])
        plain = coord.generate(prompt, params, use_cache=False, speculative=False)
        spec = coord.generate(prompt, params)
        assert spec.tokens == plain.tokens and "Revolution" in spec.text
        assert spec.acceptance_length > 1.4
    with Coordinator(cfg) as coord:
        again = coord.generate(prompt, params)
        assert again.cache_tier == "disk" and again.tokens == plain.tokens
        assert again.acceptance_length == spec.acceptance_length


@pytest.mark.slow
def test_draft_hung_during_a_cache_operation_stops_only_speculation(target, fitted, tmp_path):
    """A draft that stops answering while a snapshot waits for its part: the snapshot goes on
    without the feature rows, within seconds (not step_timeout), and the shards keep serving."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cfg = _cfg(target, 2, fitted, kv_cache_dir=str(tmp_path), step_timeout=120,
               step_deadline_min=2.0)
    with Coordinator(cfg) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        want = coord.generate(prompt, params, use_cache=False, speculative=False).tokens
        pid = coord._draft_proc.pid
        os.kill(pid, signal.SIGSTOP)  # alive and silent
        t0 = time.monotonic()
        r = coord.generate(prompt, params, speculative=False)  # snapshots ask the draft too
        # (~6 s here: step_deadline_min once the shards have answered, then 2 s per feeding
        # shard)
        assert time.monotonic() - t0 < 10
        assert r.tokens == want and coord.draft is None and coord.failed is None
        assert wait_gone([pid]) == []
        again = coord.generate(prompt, params)
        assert again.cache_tier == "ram" and again.tokens == want
        assert again.acceptance_length is None
    assert shard_children() == []


@pytest.mark.slow
def test_speculation_required_and_the_draft_gone_fails_every_request(target, near):
    with Coordinator(_cfg(target, 2, near, spec_required=True)) as coord:
        prompt = _prompts(coord.tokenizer)[1]
        coord.generate(prompt, GREEDY, speculative=False, use_cache=False)
        coord._lose_draft("killed by the test")
        with pytest.raises(ShardFailure, match="spec_required"):
            coord.generate(prompt, GREEDY, use_cache=False)


@pytest.mark.slow
def test_verify_steps_never_exceed_the_prefill_chunk(target, fitted):
    """prefill_chunk sizes every step buffer: a draft block larger than it is cut to fit (the
    output is the reference's at that chunk, tokens and logits)."""
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=2,
                        max_context=256, threads=1, draft=str(fitted))
    ref = ReferenceEngine(target, prefill_chunk=2, max_context=256)
    with Coordinator(cfg) as coord:
        prompt = _prompts(coord.tokenizer)[1]
        spec = assert_speculated_equals(coord, prompt, GREEDY, run_logged(ref, prompt, GREEDY))
        assert spec.acceptance_length > 1.0


def test_a_dflash_draft_needs_its_feeding_shards_here(target, dflash):
    # (any DFlash draft tapping layer 4, which shard 1 holds: the random one, not the fitted
    # one, whose fitting is ~4 s of the fast tier)
    cfg = _cfg(target, 2, dflash, shard_addresses=("", "tcp://10.0.0.2:7700"))
    with pytest.raises(PlacementError, match="shard 1 is remote"):
        Coordinator(cfg)
    auto = _cfg(target, 2, "auto", shard_addresses=("", "tcp://10.0.0.2:7700"))
    assert Coordinator(auto).draft_path is None  # (no default model: auto is off anyway)
