"""Tokenizer for Hugging Face checkpoint folders, plus chat templates and streaming detokenization.

Two backends behind one class: ``tokenizer.json`` through the ``tokenizers`` library (preferred,
it is what transformers runs), else ``tokenizer.model`` through ``sentencepiece``. The
SentencePiece path mimics what transformers 5 does when it converts such a folder (special
tokens split out of the text, the dummy "▁" prefix only on the first chunk, decoding with the
Replace/ByteFallback/Fuse/Strip chain), so both paths give the same ids and text.
"""
from __future__ import annotations

import copy
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token")
# Names diffusion checkpoints use for their mask token (SDAR, Fast-dLLM v2, LLaDA2 and Dream checkpoints).
MASK_NAMES = ("<mask>", "<|mask|>", "<MASK>", "|<MASK>|", "<|mdm_mask|>")
REPLACEMENT_CHAR = "\ufffd"
FALLBACK_CHAT = "{role}: {content}\n"           # a turn, for models that ship no chat template
FALLBACK_REPLY = "assistant:"                   # the generation prompt after those lines


def fallback_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A conversation as the plain `role: content` lines sent to a model without a chat
    template (the server's rule, docs/decisions.md)."""
    text = "".join(FALLBACK_CHAT.format(role=m["role"], content=m["content"]) for m in messages)
    return text + (FALLBACK_REPLY if add_generation_prompt else "")


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist; a broken file is the caller's error."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _read_dict(path: Path) -> dict:
    data = _read_json(path)
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data or {}


def _content(token: Any) -> str | None:
    """Special tokens are written either as plain strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class _Backend(Protocol):
    vocab_size: int
    special_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def id_to_token(self, i: int) -> str | None: ...
    def token_bytes(self, i: int) -> bytes: ...
    def token_to_id(self, s: str) -> int | None: ...
    def mark_special(self, contents: list[str]) -> None: ...


class _HFBackend:
    """tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        # deferred: tokenizers loads only for a tokenizer.json
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises bare Exception for parse errors
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from e
        added = self.tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        self._added_ids = set(added)
        self._byte_level: dict[str, int] | None = None
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        token = self.tok.id_to_token(i) or ""
        if i in self._added_ids:
            return token.encode()
        if self._byte_level is None:           # the decoder's kind, read once
            decoder = json.loads(self.tok.to_str()).get("decoder") or {}
            kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
            self._byte_level = _byte_decoder() if "ByteLevel" in kinds else {}
        if self._byte_level:
            try:
                return bytes(self._byte_level[c] for c in token)
            except KeyError:
                return token.encode()
        byte = _BYTE_PIECE.fullmatch(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode()

    def token_to_id(self, s: str) -> int | None:
        return self.tok.token_to_id(s)

    def mark_special(self, contents: list[str]) -> None:
        # transformers registers the config's special tokens as special added tokens at load time,
        # so they are split out of text and skipped on decode; do the same for tokens in the vocab.
        # deferred: tokenizers loads only for a tokenizer.json
        from tokenizers import AddedToken

        known = [c for c in contents if self.tok.token_to_id(c) is not None]
        self.tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in known])
        self.special_ids |= {self.tok.token_to_id(c) for c in known}
        self._added_ids |= {self.tok.token_to_id(c) for c in known}


def _sp_processor(proto: Any, dummy_prefix: bool) -> Any:
    # deferred: sentencepiece loads only for a tokenizer.model
    import sentencepiece as spm

    proto.normalizer_spec.add_dummy_prefix = dummy_prefix
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


class _SPBackend:
    """tokenizer.model through `sentencepiece`, made to behave like transformers' conversion."""

    def __init__(self, path: Path, config: dict) -> None:
        # deferred: sentencepiece loads only for a tokenizer.model
        from sentencepiece import sentencepiece_model_pb2 as pb2

        proto = pb2.ModelProto()
        try:
            proto.ParseFromString(path.read_bytes())
            if not proto.pieces:
                raise ValueError("no pieces")
            own_prefix = proto.normalizer_spec.add_dummy_prefix  # read before _sp_processor sets it
            # One processor with the dummy "▁" prefix, one without (chunks after the first, in
            # transformers' non-legacy mode, and chunks that already start with a space).
            self.sp, self.sp_bare = (_sp_processor(proto, prefix) for prefix in (True, False))
        except Exception as e:  # protobuf and sentencepiece raise assorted types
            raise ValueError(f"{path}: not a SentencePiece model ({e})") from e
        # transformers lets tokenizer_config's add_prefix_space override the model's own setting.
        prefix = config.get("add_prefix_space")
        self.dummy_prefix = prefix if isinstance(prefix, bool) else own_prefix
        self.legacy = bool(config.get("legacy", False))
        self.add_bos = bool(config.get("add_bos_token", True))
        self.add_eos = bool(config.get("add_eos_token", False))
        # -1 when the model has none; Tokenizer._resolve falls back to these.
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()
        n = self.sp.get_piece_size()
        self.special_ids = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self.added: dict[str, int] = {}  # atomic tokens split out of text before SentencePiece
        self.added_pieces: dict[int, str] = {}  # added tokens beyond the SentencePiece vocabulary
        for key, tok in (config.get("added_tokens_decoder") or {}).items():
            self._add(int(key), _content(tok), isinstance(tok, dict) and tok.get("special", False))
        self._split_re: re.Pattern | None = None
        self.vocab_size = max([n - 1, *self.added_pieces]) + 1

    def _add(self, i: int, content: str | None, special: bool) -> None:
        if content is None:
            return
        self.added[content] = i
        if i >= self.sp.get_piece_size():
            self.added_pieces[i] = content
        if special:
            self.special_ids.add(i)
        self._split_re = None

    def mark_special(self, contents: list[str]) -> None:
        for c in contents:
            i = self.token_to_id(c)
            if i is not None:
                self._add(i, c, True)

    def token_to_id(self, s: str) -> int | None:
        if s in self.added:
            return self.added[s]
        i = self.sp.piece_to_id(s)
        # piece_to_id answers unk for unknown pieces; only the unk piece itself maps to it
        return None if self.sp.is_unknown(i) and self.sp.id_to_piece(i) != s else i

    def id_to_token(self, i: int) -> str | None:
        if i in self.added_pieces:
            return self.added_pieces[i]
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def token_bytes(self, i: int) -> bytes:
        if i in self.added_pieces:
            return self.added_pieces[i].encode()
        if not 0 <= i < self.sp.get_piece_size():
            return b""
        if self.sp.is_byte(i):
            return bytes([int(self.sp.id_to_piece(i)[3:5], 16)])
        return self.sp.id_to_piece(i).replace("\u2581", " ").encode()

    def _chunks(self, text: str) -> list[tuple[int, str | int]]:
        """(offset, text or added-token id) pieces of text, added tokens split out longest-first."""
        if not self.added:
            return [(0, text)] if text else []
        if self._split_re is None:
            names = sorted(self.added, key=len, reverse=True)
            self._split_re = re.compile("|".join(re.escape(n) for n in names))
        chunks: list[tuple[int, str | int]] = []
        pos = 0
        for m in self._split_re.finditer(text):
            if m.start() > pos:
                chunks.append((pos, text[pos : m.start()]))
            chunks.append((m.start(), self.added[m.group()]))
            pos = m.end()
        if pos < len(text):
            chunks.append((pos, text[pos:]))
        return chunks

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_id >= 0:
            ids.append(self.bos_id)
        for offset, chunk in self._chunks(text):
            if isinstance(chunk, int):
                ids.append(chunk)
                continue
            # Like Metaspace(prepend_scheme="first"): "▁" goes before the first chunk only, and
            # not when the chunk already starts with a space (which becomes that "▁").
            prefix = self.dummy_prefix and (offset == 0 or self.legacy) and not chunk.startswith(" ")
            ids.extend((self.sp if prefix else self.sp_bare).encode(chunk))
        if add_special_tokens and self.add_eos and self.eos_id >= 0:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i in self.added_pieces:
                out += self.added_pieces[i].encode()
            elif not 0 <= i < self.sp.get_piece_size():
                continue  # ids past the vocabulary (padded embeddings) decode to nothing, as in HF
            elif self.sp.is_byte(i):
                out.append(int(self.sp.id_to_piece(i)[3:5], 16))  # "<0xAB>"
            else:
                out += self.sp.id_to_piece(i).replace("▁", " ").encode()
        text = out.decode("utf-8", errors="replace")
        return text[1:] if self.dummy_prefix and text.startswith(" ") else text


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    others for the characters from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization for tokenizers whose config asks for it."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _load_chat_template(folder: Path, config: dict) -> tuple[str | None, Path | None]:
    """The template text and the file it came from; transformers 5 saves it as chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), folder / "chat_template.jinja"
    data = _read_json(folder / "chat_template.json")
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
        return data["chat_template"], folder / "chat_template.json"
    return None, None


def _compile_template(source: str, origin: Path | None):
    # deferred: jinja2 loads only when a chat template is compiled
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: chat template has a syntax error ({e})") from e


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint folder."""

    def __init__(self, backend: _Backend, folder: Path, config: dict, model_configs: list[dict]) -> None:
        self._backend = backend
        self.folder = folder
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self._special_strings = self._named_special_tokens(config)
        backend.mark_special(self._extra_specials(config) + list(self._special_strings.values()))
        self.vocab_size: int = backend.vocab_size
        self.special_token_ids: set[int] = set(backend.special_ids)
        self.bos_token_id = self._resolve("bos_token", model_configs, "bos_token_id")
        self.pad_token_id = self._resolve("pad_token", model_configs, "pad_token_id")
        self.unk_token_id = self._resolve("unk_token", [], "unk_token_id")
        self.eos_token_ids: list[int] = self._resolve_eos(model_configs)
        self.mask_token_id = self._resolve_mask(model_configs)
        self._template, self._template_origin = _load_chat_template(folder, config)
        self._compiled = None
        self.has_chat_template: bool = self._template is not None
        # whether the template writes a `tools` list itself (else serve/tools.py's fallback does)
        self.template_reads_tools: bool = self._template is not None and "tools" in self._template

    def use_chat_template(self, template: str) -> None:
        """Replace the model's chat template: `template` is a file holding one, or the Jinja text
        itself (vLLM's --chat-template). Compiled now, so that a broken one is named at once."""
        path = Path(template) if "\n" not in template and len(template) < 4096 else None
        if path is not None and path.is_file():
            source, origin = path.read_text(encoding="utf-8"), path
        elif "{{" in template or "{%" in template:
            source, origin = template, None
        else:
            raise ValueError(f"chat_template={template[:80]!r}: no such file, and not a Jinja template")
        compiled = _compile_template(source, origin or Path("chat_template"))
        self._template, self._template_origin, self._compiled = source, origin, compiled
        self.has_chat_template = True
        self.template_reads_tools = "tools" in source

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        folder = Path(path)
        config = _read_dict(folder / "tokenizer_config.json")
        model_configs = [_read_dict(folder / n) for n in ("generation_config.json", "config.json")]
        if (folder / "tokenizer.json").is_file():
            backend: _Backend = _HFBackend(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").is_file():
            backend = _SPBackend(folder / "tokenizer.model", config)
        else:
            raise FileNotFoundError(f"{folder}: no tokenizer.json or tokenizer.model in this folder")
        return cls(backend, folder, config, model_configs)

    # --- special tokens -------------------------------------------------------------------

    @staticmethod
    def _named_special_tokens(config: dict) -> dict[str, str]:
        named = {key: _content(config.get(key)) for key in SPECIAL_KEYS}
        return {k: v for k, v in named.items() if v is not None}

    @staticmethod
    def _extra_specials(config: dict) -> list[str]:
        extra: list[str] = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = config.get(key) or []
            # transformers 5 allows a {name: token} dict for extra_special_tokens
            items = list(value.values()) if isinstance(value, dict) else value
            extra += [c for c in map(_content, items if isinstance(items, list) else []) if c is not None]
        return extra

    def _resolve(self, key: str, model_configs: list[dict], id_key: str) -> int | None:
        """Token named in tokenizer_config, else the backend's own (SentencePiece), else config files."""
        if key in self._special_strings:
            i = self.token_to_id(self._special_strings[key])
            if i is not None:
                return i
        own = getattr(self._backend, key.replace("_token", "_id"), -1)
        if isinstance(own, int) and own >= 0:
            return own
        for cfg in model_configs:
            ids = _as_id_list(cfg.get(id_key))
            if ids:
                return ids[0]
        return None

    def _resolve_eos(self, model_configs: list[dict]) -> list[int]:
        first = self._resolve("eos_token", [], "eos_token_id")
        ids = [first] if first is not None else []
        for cfg in model_configs:  # generation_config.json, then config.json
            ids += _as_id_list(cfg.get("eos_token_id"))
        return list(dict.fromkeys(ids))  # de-duplicated, order kept

    def _resolve_mask(self, model_configs: list[dict]) -> int | None:
        # config.json's mask_token_id covers SDAR, which names no mask_token in tokenizer_config.
        found = self._resolve("mask_token", model_configs, "mask_token_id")
        names = (self.token_to_id(name) for name in MASK_NAMES)
        return found if found is not None else next((i for i in names if i is not None), None)

    # --- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        text = self._backend.decode(list(ids))
        return _clean_up_spaces(text) if self._clean_up else text

    def token_bytes(self, i: int) -> bytes:
        """The bytes a token stands for on its own: a byte-level or byte-fallback token inside a
        multi-byte character is part of one; a SentencePiece word start begins with a space. An
        id past the vocabulary (a padded embedding) stands for nothing, as it decodes to nothing."""
        if self._backend.id_to_token(i) is None:
            return b""
        return self._backend.token_bytes(i)

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary of {self.vocab_size}")
        return token

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    # --- chat -----------------------------------------------------------------------------

    def hf_json(self) -> str | None:
        """The tokenizer as Hugging Face tokenizers' JSON (what grammar engines read), or None for
        a SentencePiece-only folder."""
        tok = getattr(self._backend, "tok", None)
        return tok.to_str() if tok is not None and hasattr(tok, "to_str") else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("model has no chat template")
        if self._compiled is None:
            self._compiled = _compile_template(self._template, self._template_origin)
        if "developer" not in self._template:
            # OpenAI's newer name for the system role, which the OpenAI SDK sends for instructions:
            # a template that does not know it reads it as the system message it is
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        # What transformers exposes to templates: the special token strings, tools, documents.
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_strings}
        context.update(kwargs)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """The ids of a rendered chat: encoded with the special tokens, less the second BOS where the
    template wrote one and encoding added another."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


# --- tools in a conversation -------------------------------------------------------------------
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FALLBACK_TOOLS_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions are described in JSON Schema within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def tool_messages(messages: list[dict], tools: list[dict] | None,
                  template_reads_tools: bool) -> tuple[list[dict], dict]:
    """(messages, template keyword arguments) of a conversation with OpenAI's tools, calls and
    results. A template that reads `tools` gets them, and the calls' arguments as objects;
    otherwise Hermes's format (vLLM's hermes parser) writes tools, calls and results into plain
    messages."""
    if template_reads_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": list(tools)} if tools else {})
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                              f"\n{TOOL_CALL_CLOSE}" for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        block = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _arguments(call: dict) -> Any:
    """A history call's arguments as an object (OpenAI sends them as a JSON string)."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}


def open_final_message(text: str, final: str) -> str:
    """A rendered chat cut right after its final message's content (what the template wrote after
    it ends the turn), as transformers' continue_final_message cuts it; ValueError where the
    template does not write that content as it is."""
    for needle in (final, final.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[:at + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the final message's content "
                     "as it is, so it cannot be left open")


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    Decoding one token alone is wrong twice over: SentencePiece pieces lose their leading space
    at the start of a decode, and byte-fallback / byte-level tokens may hold part of a UTF-8
    character. So each step decodes a short window of preceding ids plus the new ones and emits
    the difference, and holds text back while it ends in U+FFFD (a character still incomplete).
    """

    CONTEXT = 5  # preceding prompt ids used as decoding context
    MAX_PENDING = 16  # no valid character needs this many tokens: give up waiting and emit

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = self._context(list(prompt_ids))  # window: already-emitted ids, then pending
        self._read = len(self._ids)  # ids before this index have been turned into text
        self._prefix_text = self._decode(self._ids)
        self.text = ""

    def _context(self, prompt_ids: list[int]) -> list[int]:
        # Start the window on a character boundary: a window whose first token is a stray UTF-8
        # continuation byte decodes differently once more bytes follow it in the same run.
        start = max(len(prompt_ids) - self.CONTEXT, 0)
        limit = max(start - self.MAX_PENDING, 0)
        while start > limit and self._decode(prompt_ids[start : start + 1]).startswith(REPLACEMENT_CHAR):
            start -= 1
        return prompt_ids[start:]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def fork(self) -> "IncrementalDetokenizer":
        """A copy that goes on apart from this one (what another next token would add)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def add(self, new_ids: list[int]) -> str:
        # One id at a time so that a complete prefix of a multi-token commit is not held back.
        pieces = [self._step(i) for i in new_ids]
        piece = "".join(pieces)
        self.text += piece
        return piece

    def add_all(self, new_ids: list[int]) -> str:
        """What add(new_ids) returns, in one decode when it can be: a finished offline request's
        whole output. When the decoded text past the window is whole characters (no U+FFFD), it
        is exactly what id-by-id steps would emit piece by piece; otherwise it steps as add()."""
        ids = self._ids + list(new_ids)
        full = self._decode(ids)
        if not new_ids or not full.startswith(self._prefix_text) or \
                REPLACEMENT_CHAR in full[len(self._prefix_text):]:
            return self.add(new_ids)
        piece = full[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = ids, len(ids), full
        self.text += piece
        return piece

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        full = self._decode(self._ids)
        incomplete = full.endswith(REPLACEMENT_CHAR) and len(self._ids) - self._read < self.MAX_PENDING
        if incomplete or len(full) <= len(self._prefix_text):
            return ""
        return self._advance(full)

    def _advance(self, full: str) -> str:
        piece = full[len(self._prefix_text) :]
        # The ids just emitted become the next window's context.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return piece

    def flush(self) -> str:
        full = self._decode(self._ids)
        piece = self._advance(full) if len(full) > len(self._prefix_text) else ""
        self.text += piece
        return piece
