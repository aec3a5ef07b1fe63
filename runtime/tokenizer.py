"""Tokenizer and chat template of a checkpoint (HF folder or GGUF), via `tokenizers` and jinja2."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from layersplit.runtime.text_prefixes import PrefixIds
from layersplit.runtime.tool_calls import hermes_messages, tool_format
from layersplit.shards.errors import CheckpointError
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tk_models

log = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.pre` -> regex splits applied before the byte-level step (llama.cpp's table).
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str, path: Path):
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE}.get(pre)
    if regex is None:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not supported "
            "(supported: smollm, gpt2, default, llama-bpe, qwen2)"
        )
    from tokenizers import Regex

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    """Encode/decode text and render chat templates the way transformers does."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        source: str,
    ) -> None:
        self.tk = tokenizer
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source = source

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def for_model(cls, path: str | Path) -> TextTokenizer | None:
        """The model's tokenizer; None for random weights (they have none)."""
        if str(path).startswith("random:"):
            return None
        return cls.from_path(path)

    @classmethod
    def from_path(cls, path: str | Path) -> TextTokenizer:
        p = Path(path).expanduser()
        if p.is_dir():
            return cls.from_hf_folder(p)
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        raise CheckpointError(f"{p}: expected a Hugging Face model folder or a .gguf file")

    @classmethod
    def from_hf_folder(cls, folder: Path) -> TextTokenizer:
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{folder}: no tokenizer.json")
        try:
            tk = Tokenizer.from_file(str(tj))
        except Exception as e:
            raise CheckpointError(f"{tj}: cannot load tokenizer ({e})") from e
        tk.no_truncation()  # (a file's truncation or padding would cut or pad every prompt,
        tk.no_padding()  # and a prefix's ids would differ from a whole encode's)
        tcfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        mcfg = _read_json(folder / "config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()

        def tok_id(key: str) -> int | None:
            text = _token_text(tcfg.get(key))
            return None if text is None else tk.token_to_id(text)

        eos: list[int] = []
        for src in (gen.get("eos_token_id"), mcfg.get("eos_token_id"), tok_id("eos_token")):
            if isinstance(src, int):
                eos.append(src)
            elif isinstance(src, list):
                eos.extend(int(x) for x in src)
        bos = tok_id("bos_token")
        if bos is None and isinstance(mcfg.get("bos_token_id"), int):
            bos = mcfg["bos_token_id"]
        return cls(
            tk,
            bos_id=bos,
            eos_ids=eos,
            add_bos=False,  # tokenizer.json's post-processor adds BOS where the model wants it
            chat_template=template,
            source=str(folder),
        )

    @classmethod
    def from_gguf(cls, path: Path) -> TextTokenizer:
        from layersplit.shards.checkpoint_gguf import GGUFFile

        g = GGUFFile(path)
        model = g.field("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(
                f"{path}: tokenizer.ggml.model={model!r} is not supported (supported: gpt2 BPE)"
            )
        tokens = [str(t) for t in g.field("tokenizer.ggml.tokens")]
        merges = [tuple(m.split(" ", 1)) for m in g.field("tokenizer.ggml.merges")]
        types = list(g.field("tokenizer.ggml.token_type"))
        tk = Tokenizer(
            tk_models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        tk.pre_tokenizer = _gguf_pre_tokenizer(str(g.field("tokenizer.ggml.pre", "default")), path)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False)
             for i, t in enumerate(types) if t == 3]
        )
        tk.add_tokens(
            [AddedToken(tokens[i], special=False, normalized=False)
             for i, t in enumerate(types) if t == 4]
        )
        eos = g.field("tokenizer.ggml.eos_token_id", None)
        eot = g.field("tokenizer.ggml.eot_token_id", None)
        return cls(
            tk,
            bos_id=g.field("tokenizer.ggml.bos_token_id", None),
            eos_ids=[int(x) for x in (eos, eot) if x is not None],
            add_bos=bool(g.field("tokenizer.ggml.add_bos_token", False)),
            chat_template=g.field("tokenizer.chat_template", None),
            source=str(path),
        )

    # ---- text <-> ids -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    # ---- chat ---------------------------------------------------------------------------------
    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise CheckpointError(
                f"{self.source}: the model has no chat template; send a plain prompt instead"
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the template writes it; `tools` (OpenAI's tool definitions)
        are passed to the template as transformers passes them, or, where the template writes
        no tool calls, written into the messages in the Hermes format
        (`runtime.tool_calls.hermes_messages`)."""
        def text(i: int | None) -> str:
            return "" if i is None else (self.tk.id_to_token(i) or "")

        def render(msgs: Sequence[dict[str, Any]], tools: Any) -> str:
            return self._template.render(
                messages=list(msgs),
                add_generation_prompt=add_generation_prompt,
                bos_token=text(self.bos_id),
                eos_token=text(self.eos_ids[0] if self.eos_ids else None),
                **({"tools": list(tools)} if tools else {}),
            )

        if not tools or tool_format(self.chat_template) is not None:
            return render(messages, tools)
        # the template writes no tool calls: the messages carry them (`hermes_messages`), with
        # the tools in a system message, or in the first user message where it takes none
        try:
            return render(hermes_messages(list(messages), list(tools)), None)
        except jinja2.exceptions.TemplateError:
            return render(hermes_messages(list(messages), list(tools), system=False), None)

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation, ready for the assistant's turn (or, without
        `add_generation_prompt`, ending with its last message)."""
        return self._prefix_ids.encode(self.render_chat(messages, add_generation_prompt,
                                                        tools=tools))

    @cached_property
    def _prefix_ids(self) -> PrefixIds:
        """The ids of the conversations encoded last, to encode the next turn's from
        (`runtime.text_prefixes`): its new messages are tokenized, not the whole of it."""
        return PrefixIds(self.tk)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
    return data if isinstance(data, dict) else {}
