"""A conversation's next turn is encoded from the ids of the text it starts with, into exactly
the ids of a whole encode; tokenizers that could read a piece differently by its place are
encoded whole."""

from __future__ import annotations

import pytest
from layersplit.runtime.text_prefixes import PrefixIds, boundary_ids
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.chunking import cut_points
from layersplit.shards.tiny import tiny_tokenizer
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers import models as tk_models


class Counting:
    """A tokenizer that records the length of each text it encodes."""

    def __init__(self, tk: Tokenizer) -> None:
        self.tk, self.lengths = tk, []

    def encode(self, text: str, add_special_tokens: bool = True):
        self.lengths.append(len(text))
        return self.tk.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tk, name)


def turns(tok: TextTokenizer) -> list[tuple[list[dict], bool]]:
    """A conversation as a server sees it: each request, then its answer kept (no generation
    prompt); contents with digits, emoji, spaces at their ends and a special token's text."""
    msgs = [{"role": "system", "content": "You are an agent. 12345 tools follow. "},
            {"role": "user", "content": "Read the file  "}]
    out = [([*msgs], True)]
    answers = ["  I will read it.\n", "Done 🙂 <|im_end|> then 42", " ", "end<|im_start|>"]
    for i, a in enumerate(answers):
        msgs.append({"role": "assistant", "content": a})
        out.append(([*msgs], False))
        msgs.append({"role": "user", "content": f"result {i}: " + "x" * (7 * i) + "\n\n"})
        out.append(([*msgs], True))
    return out


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_next_turns_encode_as_a_whole_encode(which, request):
    if which == "default":
        tok = TextTokenizer.from_path(request.getfixturevalue("default_model"))
    else:
        tok = TextTokenizer.from_path(request.getfixturevalue("tiny_llama"))
    whole = TextTokenizer(tok.tk, bos_id=tok.bos_id, eos_ids=tok.eos_ids, add_bos=tok.add_bos,
                          chat_template=tok.chat_template, source="whole")
    counting = Counting(tok.tk)
    tok._prefix_ids = PrefixIds(counting)
    assert tok._prefix_ids.safe
    for i, (msgs, gen) in enumerate(turns(tok)):
        text = whole.render_chat(msgs, gen)
        assert tok.encode_chat(msgs, add_generation_prompt=gen) == \
            whole.encode(text, add_special_tokens=False)
        if i:  # (the new messages are encoded, not the conversation)
            assert counting.lengths[-1] < len(text) // 2
    # a branch: an earlier turn edited starts from an older prefix, and is right too
    msgs = turns(tok)[2][0]
    msgs[-1] = {"role": "user", "content": "something else"}
    assert tok.encode_chat(msgs) == whole.encode(whole.render_chat(msgs),
                                                 add_special_tokens=False)


def test_only_safe_boundaries():
    tk = tiny_tokenizer()
    assert boundary_ids(tk) == {tk.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>",
                                                            "<|endoftext|>")}
    tk.add_special_tokens([AddedToken("<|s|>", special=True, normalized=False, rstrip=True),
                           AddedToken("<|im_end|>x", special=True, normalized=False)])
    safe = boundary_ids(tk)
    assert tk.token_to_id("<|s|>") not in safe  # (it takes the whitespace after it)
    assert tk.token_to_id("<|im_end|>") not in safe  # (a longer token starts with it)
    # a Metaspace that prepends only to the first piece reads pieces by their place
    sp = Tokenizer(tk_models.BPE(vocab={"a": 0, "▁": 1, "<s>": 2}, merges=[]))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    sp.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    assert boundary_ids(sp) == frozenset()
    ids = PrefixIds(sp)
    assert ids.encode("a<s>a") == sp.encode("a<s>a", add_special_tokens=False).ids
    assert ids.encode("a<s>a<s>a") == sp.encode("a<s>a<s>a", add_special_tokens=False).ids


def test_an_added_token_inside_a_longer_one_is_no_boundary():
    """`a<e>b` holds `<e>` past its first character: encoded after a prefix that ends with
    `<e>`, "b z" would lose the `a<e>b` a whole encode reads."""
    tk = Tokenizer(tk_models.WordLevel({"q": 0, "a": 1, "b": 2, "c": 3, "z": 4, "[UNK]": 5},
                                       unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken("<e>", special=True, normalized=False),
                           AddedToken("a<e>b", special=True, normalized=False)])
    assert boundary_ids(tk) == {tk.token_to_id("a<e>b")}
    ids = PrefixIds(tk)
    for text in ("q a<e>c", "q a<e>b z"):
        assert ids.encode(text) == tk.encode(text, add_special_tokens=False).ids
    assert ids.encode("q a<e>b z") == [0, tk.token_to_id("a<e>b"), 4]


def test_a_files_truncation_and_padding_are_off(tmp_path):
    tk = tiny_tokenizer()
    tk.enable_truncation(4)
    tk.enable_padding(length=64)
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer.from_hf_folder(tmp_path)
    assert tok.tk.truncation is None and tok.tk.padding is None
    text = "a longer text than four tokens, by far"
    assert tok.encode(text, add_special_tokens=False) == \
        tiny_tokenizer().encode(text, add_special_tokens=False).ids


def test_remembered_prefixes_are_bounded():
    tk = tiny_tokenizer()
    ids = PrefixIds(tk, keep=3)
    for i in range(6):
        ids.encode(f"<|im_start|>user\n{i}<|im_end|>\n")
    assert len(ids._known) == 3
    assert [p for p, _ in ids._known][0].startswith("<|im_start|>user\n5")


def test_cut_points_after_every_turn_end():
    tokens = [5, 2, 7, 2, 2, 9, 3, 4, 2]
    for chunk, ends, end in ((4, (2,), None), (3, {2, 3}, 7), (100, [9], None), (2, (), 5)):
        want = sorted(set(range(chunk, (end or len(tokens)) + 1, chunk)) |
                      {i + 1 for i in range(end or len(tokens)) if tokens[i] in ends})
        assert cut_points(tokens, chunk, ends, end) == want
        assert cut_points(tuple(tokens), chunk, ends, end) == want
