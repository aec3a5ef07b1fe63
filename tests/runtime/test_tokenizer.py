"""Chat templates render as transformers renders them; streaming text handles UTF-8 and stops."""

from __future__ import annotations

import json

import pytest
from layersplit.runtime.textstream import TextStream
from layersplit.runtime.tokenizer import TextTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye 🙂"},
]


def test_chat_template_matches_transformers(tiny_llama):
    transformers = pytest.importorskip("transformers")
    ours = TextTokenizer.from_path(tiny_llama)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    text = ours.render_chat(MESSAGES)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(MESSAGES) == list(ids)


# A template in the style of gpt-oss's "harmony" format, written for this test: a system block
# with today's date and a reasoning effort, a developer block, channels, macros, a namespace
# and a filtered loop, rendered from a chat_template.jinja file.
HARMONY_STYLE = """{%- macro block(role, text, channel=none) -%}
<|start|>{{ role }}{% if channel %}<|channel|>{{ channel }}{% endif %}<|message|>{{ text }}<|end|>
{%- endmacro -%}
{%- set ns = namespace(developer="") -%}
{%- if messages[0].role == "system" -%}{%- set ns.developer = messages[0].content -%}{%- endif -%}
{{ block("system", "Knowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d")
   + "\nReasoning: " + (reasoning_effort if reasoning_effort is defined else "medium")) }}
{%- if ns.developer %}{{ block("developer", "# Instructions\n" + ns.developer) }}{% endif -%}
{%- for m in messages if m.role != "system" -%}
{%- if m.role == "assistant" -%}{{ block("assistant", m.content, "final") }}
{%- else -%}{{ block(m.role, m.content) }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"""


def test_harmony_style_template_file_matches_transformers(tmp_path):
    """A chat_template.jinja (transformers 5 saves templates so, gpt-oss ships one) renders as
    transformers renders it."""
    transformers = pytest.importorskip("transformers")
    from layersplit.shards.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "oss", "gpt_oss", num_layers=2)
    cfg = folder / "tokenizer_config.json"
    raw = json.loads(cfg.read_text())
    del raw["chat_template"]
    cfg.write_text(json.dumps(raw))
    (folder / "chat_template.jinja").write_text(HARMONY_STYLE)
    ours = TextTokenizer.from_path(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<|channel|>final<|message|>Hello.<|end|>" in want and "Reasoning: medium" in want
    assert ours.render_chat(MESSAGES) == want


def test_template_errors_are_clear(tmp_path):
    from layersplit.shards.errors import CheckpointError
    from layersplit.shards.tiny import tiny_tokenizer

    tk = TextTokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[2], add_bos=False,
                       chat_template=None, source="x")
    with pytest.raises(CheckpointError, match="no chat template"):
        tk.render_chat(MESSAGES)


def _stream(tk, text, stop=()):
    ids = tk.encode(text, add_special_tokens=False)
    s = TextStream(tk, stop)
    out = ""
    for i in ids:
        out += s.push(i)
        if s.stopped:
            break
    return out + s.finish(), s.stopped


def test_stream_reassembles_utf8(tiny_llama):
    tk = TextTokenizer.from_path(tiny_llama)
    text = "naïve 日本語 🙂 end"
    out, stopped = _stream(tk, text)
    assert out == text and not stopped


def test_stream_stop_strings_span_tokens(tiny_llama):
    tk = TextTokenizer.from_path(tiny_llama)
    out, stopped = _stream(tk, "alpha beta STOP gamma", stop=("STOP",))
    assert stopped and out == "alpha beta "
    out, stopped = _stream(tk, "alpha ST beta", stop=("STOP",))
    assert not stopped and out == "alpha ST beta"  # held-back prefix released at the end
