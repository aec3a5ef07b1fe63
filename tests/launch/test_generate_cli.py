"""`layersplit generate` with a prompt of token ids (`--token-ids`): the same tokens as the
text they encode; a model without a tokenizer (random weights) asks for them by name instead of
failing on the text; ids that are not ids are refused by name. (The command runs in this
process, its shards forked from the test run's zygote: `tests.helpers.run_cli`.)"""

from __future__ import annotations

import json
import subprocess

import pytest
from layersplit.runtime.tokenizer import TextTokenizer

from tests.helpers import run_cli, shard_children


def _generate(*runs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`layersplit generate ARGV` for each ARGV of `runs`, one after the other."""
    return [run_cli("generate", *argv, "--devices", "cpu", "--threads", "1", "--max-tokens",
                    "6", "--ignore-eos", "--json", "--draft", "none") for argv in runs]


@pytest.mark.slow
def test_token_ids_give_the_tokens_of_their_text(tiny_llama):
    text = "the cat sat on the mat"
    ids = TextTokenizer.from_path(tiny_llama).encode(text)
    by_text, by_ids, bad = _generate(
        (text, "--model", str(tiny_llama)),
        (",".join(map(str, ids)), "--token-ids", "--model", str(tiny_llama)),
        ("1,two,3", "--token-ids", "--model", str(tiny_llama)))
    assert by_text.returncode == 0 and by_ids.returncode == 0, by_ids.stderr[-2000:]
    assert json.loads(by_ids.stdout)["tokens"] == json.loads(by_text.stdout)["tokens"]
    got = json.loads(by_ids.stdout)  # (no draft: no speculation statistics)
    assert got["acceptance_length"] is got["spec_rounds"] is got["spec_off_steps"] is None
    assert bad.returncode == 2 and "'1,two,3' is not token ids" in bad.stderr
    assert shard_children() == []


@pytest.mark.slow
def test_a_model_without_a_tokenizer_asks_for_token_ids():
    r, ok = _generate(("hello", "--model", "random:smollm2-135m-shape"),
                      ("5 6 7 8", "--token-ids", "--model", "random:smollm2-135m-shape"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "has no tokenizer (random weights): give the prompt as token ids with --token-ids" \
        in r.stderr
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert len(json.loads(ok.stdout)["tokens"]) == 6
    assert shard_children() == []
