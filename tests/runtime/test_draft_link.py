"""`runtime.draft_link`: the start's last wait on the draft process (`_draft_warmed`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from layersplit.runtime.draft_link import DraftLink, check_same_vocab
from layersplit.runtime.errors import ShardFailure
from layersplit.shards.errors import CheckpointError
from tokenizers import Tokenizer, models


def test_a_draft_lost_before_its_warm_up_was_answered_fails_the_start():
    """A draft process that died while the shards warmed up (their waits saw it first and
    dropped it) fails the start as a failed warm-up does, naming why; with no draft at all
    there is nothing to wait for."""
    lost = SimpleNamespace(draft=None, draft_path="/drafts/d", draft_down="killed by signal 9")
    with pytest.raises(ShardFailure, match="could not start: killed by signal 9"):
        DraftLink._draft_warmed(lost, 0.0)
    DraftLink._draft_warmed(SimpleNamespace(draft=None, draft_path=None, draft_down=None), 0.0)


def _tokenizer_folder(path: Path, vocab: dict[str, int]) -> Path:
    path.mkdir()
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def test_a_classic_draft_needs_the_targets_vocabulary(tmp_path):
    """`check_same_vocab`, run by the coordinator before it starts a classic draft: the same
    tokens with the same ids; another vocabulary is refused by name, random weights pass."""
    from layersplit.runtime.tokenizer import TextTokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2}
    target = TextTokenizer.for_model(_tokenizer_folder(tmp_path / "target", vocab))
    check_same_vocab(_tokenizer_folder(tmp_path / "same", dict(vocab)), target)
    check_same_vocab("random:smollm2-135m-shape", target)  # (no tokenizer: nothing to check)
    check_same_vocab(tmp_path / "same", None)  # (a random target)
    swapped = _tokenizer_folder(tmp_path / "swapped", {"<unk>": 0, "a": 2, "b": 1})  # (other ids)
    with pytest.raises(CheckpointError, match="swapped: the draft's tokenizer differs"):
        check_same_vocab(swapped, target)
    with pytest.raises(CheckpointError, match="the classic draft .*no tokenizer.json"):
        check_same_vocab(tmp_path, target)


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_the_coordinator_checks_a_classic_drafts_vocabulary_on_every_launcher(tmp_path,
                                                                             launcher):
    """`DraftLink._check_draft_placement` refuses a classic draft of another vocabulary before
    any process starts, under Ray too (its draft process checks the size only)."""
    from layersplit.runtime.tokenizer import TextTokenizer

    target = TextTokenizer.for_model(_tokenizer_folder(tmp_path / "t", {"<unk>": 0, "a": 1}))
    link = DraftLink()
    link.draft_path = _tokenizer_folder(tmp_path / "d", {"<unk>": 0, "b": 1})
    link.tokenizer = target
    link.config = SimpleNamespace(launcher=launcher, draft=str(link.draft_path))
    link.placement = SimpleNamespace(shards=[SimpleNamespace(device="cpu", address=None)])
    link.draft_device = "cpu"
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        link._check_draft_placement()
