"""GGUF files (llama.cpp's format): a model folder made from the file's metadata, the weights read
from the file itself.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from leapfrog.checkpoint.build import cache_root

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "gguf_source.json"
FORMAT = 6                 # bump when the folder made from a file changes
# Tokens that end a turn or a text wherever a vocabulary has them, as llama.cpp's loader takes
# them: many files name only `eos_token_id` (Gemma 3's ends its turns with <end_of_turn>).
END_OF_TURN_TOKENS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>"})
TABLE_FORMAT = 1           # bump when tensor_table's entries change
# Block types whose weights the CPU kernels keep quantized (layers/quant.py): a file holding
# them decodes with int8 products by default (llama.cpp's scheme; float32 products on request).
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")

# general.architecture -> (config.json architecture, model_type). llama.cpp's converter writes
# Mistral models (and TinyLlama, Llama 2 and 3, SmolLM) as `llama`.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# Llama 3.1's rope scaling: divisors of the rotary frequencies (model_config), not a weight
ROPE_FREQS = "rope_freqs.weight"
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS")

# GGUF tensor names -> Hugging Face names (per layer: "blk.{i}." -> "model.layers.{i}.")
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's layers have four norms; llama.cpp's `ffn_norm` is the one before the MLP in both.
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# llama.cpp's Gemma 3: every sixth layer global, the others a sliding window (its local layers'
# rotary base is fixed, not in the metadata); the 27B model (62 layers) scales queries by
# hidden / heads instead of the head size.
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62

# How llama.cpp's pre-tokenizer names split text, where transformers' converter does not know it:
# SmolLM's splits every digit apart before the GPT-2 pattern.
DIGIT_SPLIT_PRE = {"smollm"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


@functools.cache
def plain_reader_class() -> type:
    """The gguf package's reader, over its file mapping as a plain numpy array. The reader maps
    the file with np.memmap and slices it once per metadata value (a million times for a
    vocabulary of 262k tokens); a memmap's slices are memmaps, each paying the subclass's
    bookkeeping. The same mapping seen as an ndarray gives the same bytes without it
    (docs/decisions.md, "The gguf reader over a plain array"). (deferred: the gguf package loads
    only when a GGUF file is read)"""
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            self._plain_data = np.asarray(value)       # a view: the mapping stays its base

    return PlainReader


def _reader(path: Path) -> Any:
    try:
        return plain_reader_class()(str(path))
    except Exception as e:        # truncated files, bad magic, offsets past the end
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def tensor_table(path: Path, reader: Any = None) -> list[dict]:
    """Where each tensor of the file lies, as the gguf package's reader found it: name, type,
    shape, and the dtype, shape, offset and size of its data. Kept in the cache per file version:
    the reader builds a view of every metadata value, the vocabulary's included, which takes
    seconds for a vocabulary of 262k tokens, and loading needs only this."""
    st = path.stat()
    key = f"{TABLE_FORMAT}:{path}:{st.st_size}:{st.st_mtime_ns}"
    out = cache_root() / "gguf" / "tables" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    if out.is_file():
        return json.loads(out.read_text())
    reader = reader if reader is not None else _reader(path)
    table = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
              "dtype": t.data.dtype.str, "data_shape": [int(n) for n in t.data.shape],
              "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(table))
    tmp.rename(out)
    return table


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _require(reader: Any, path: Path, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"{path}: metadata key {key!r} missing")
    return value


# --- the folder --------------------------------------------------------------------------------
def materialize_gguf(path: str | os.PathLike, cache: Path, extra_generation: dict | None = None,
                     drafters: dict[str, str] | None = None) -> Path:
    """The model folder for a GGUF file (made once per file version, under `cache`); `drafters`
    (method -> drafter folder) are named in its leapfrog.json."""
    path = Path(path).resolve()
    st = path.stat()
    key = (f"{FORMAT}:{path}:{st.st_size}:{st.st_mtime_ns}:{json.dumps(extra_generation, sort_keys=True)}"
           + (f":{json.dumps(drafters, sort_keys=True)}" if drafters else ""))
    out = cache / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / SOURCE_FILE).is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        reader = _reader(path)
        config = model_config(reader, path)
        _write_json(tmp / "config.json", config)
        tokenizer_files(reader, path, tmp)
        eos = [config["eos_token_id"]] if config.get("eos_token_id") is not None else []
        eot = _field(reader, "tokenizer.ggml.eot_token_id")
        ends = [int(eot)] if eot is not None else []
        ends += [i for i, t in enumerate(_field(reader, "tokenizer.ggml.tokens") or []) if t in END_OF_TURN_TOKENS]
        eos += [i for i in dict.fromkeys(ends) if i not in eos]
        _write_json(tmp / "generation_config.json", {"bos_token_id": config.get("bos_token_id"),
                                                     "eos_token_id": eos, **(extra_generation or {})})
        # deferred: the gguf package loads only when a GGUF file is read
        from gguf import GGMLQuantizationType
        kinds = {GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
        meta: dict = {}
        if kinds & set(KERNEL_TYPES):
            meta["engine_options"] = {"matmul_precision": "int8"}
        if drafters:
            meta["drafters"] = dict(drafters)
        if meta:
            _write_json(tmp / "leapfrog.json", meta)
        tensor_table(path, reader)            # while the reader is at hand (loading reads it)
        _write_json(tmp / SOURCE_FILE, {"path": str(path), "size": st.st_size})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def source_of(folder: Path) -> Path | None:
    """The GGUF file a folder made by materialize_gguf reads its weights from."""
    meta = folder / SOURCE_FILE
    if not meta.is_file():
        return None
    data = json.loads(meta.read_text())
    path = Path(data["path"])
    if not path.is_file():
        raise CheckpointError(f"{meta}: its GGUF file {path} is gone")
    if path.stat().st_size != data["size"]:
        raise CheckpointError(f"{path}: changed since {folder} was made from it")
    return path


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def model_config(reader: Any, path: Path) -> dict:
    """config.json (Hugging Face's keys) from the file's metadata."""
    arch = str(_require(reader, path, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} (general.architecture) is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    def number(key: str, value: Any, kind: type, low: float | None = None) -> Any:
        """A metadata value as an int or a float (at least `low`), or a CheckpointError naming its key."""
        try:
            out = kind(value)
        except (TypeError, ValueError, OverflowError):
            raise CheckpointError(f"{path}: {key}={_short(value)} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if low is not None and not out >= low:
            raise CheckpointError(f"{path}: {key}={out!r} must be at least {low}")
        return out
    def get(name: str, default: Any = None, kind: type | None = None, low: float | None = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        return value if kind is None or value is None else number(f"{arch}.{name}", value, kind, low)
    def need(name: str, kind: type = int, low: float | None = 1) -> Any:
        return number(f"{arch}.{name}", _require(reader, path, f"{arch}.{name}"), kind, low)
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = get("attention.key_length", None, int, 1)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"{path}: {arch}.embedding_length={hidden} is not a multiple of "
                                  f"{arch}.attention.head_count={heads}, and the file has no {arch}.attention.key_length")
        head_dim = hidden // heads
    kv_heads = get("attention.head_count_kv", heads, int, 1)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: {arch}.attention.head_count={heads} is not a multiple of "
                              f"{arch}.attention.head_count_kv={kv_heads}")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    special_ids = {}
    for k in ("bos", "eos"):
        key = f"tokenizer.ggml.{k}_token_id"
        value = _field(reader, key)
        special_ids[k] = None if value is None else number(key, value, int, 0)
        if special_ids[k] is not None and tokens and special_ids[k] >= len(tokens):
            raise CheckpointError(f"{path}: {key}={special_ids[k]} is outside the vocabulary of {len(tokens)} tokens")
    class_name, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [class_name], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6, float, 0.0),
        "rope_theta": get("rope.freq_base", 10000.0, float, 0.0),
        "max_position_embeddings": get("context_length", 2048, int, 1),
        "vocab_size": get("vocab_size", len(tokens), int, 1),
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names, "torch_dtype": "float32",
        "bos_token_id": special_ids["bos"], "eos_token_id": special_ids["eos"],
        "gguf_name": str(_field(reader, "general.name", path.stem)),
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": need("rope.scaling.factor", float, 0.0)}
    if arch == "qwen3":
        config["use_qk_norm"] = True
    if arch == "gemma3":
        n, window = config["num_hidden_layers"], get("attention.sliding_window")
        config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                      tie_word_embeddings=True, rope_local_base_freq=GEMMA3_LOCAL_BASE,
                      query_pre_attn_scalar=hidden // heads if n == GEMMA3_27B_LAYERS else config["head_dim"],
                      layer_types=["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 or not window
                                   else "sliding_attention" for i in range(n)])
        if get("final_logit_softcapping") is not None:
            config["final_logit_softcapping"] = get("final_logit_softcapping", None, float, 0.0)
    if ROPE_FREQS in names:
        config["rope_scaling"] = {"rope_type": "default", "freq_factors": rope_freq_factors(reader, path, config)}
    if get("attention.sliding_window") is not None:
        config["sliding_window"] = get("attention.sliding_window", None, int, 1)
    return config


def rope_freq_factors(reader: Any, path: Path, config: dict) -> list[float]:
    """Llama 3.1's rope scaling as llama.cpp's converter stores it: the tensor `rope_freqs.weight`,
    one divisor per rotary frequency (1 for the high ones, the scaling factor for the low ones, a
    blend between), the config's parameters themselves left out of the metadata."""
    t = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    values = np.asarray(t.data, dtype=np.float64).reshape(-1)
    half = config["head_dim"] // 2
    if values.size != half or not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise CheckpointError(f"{path}: tensor {ROPE_FREQS!r} must hold {half} positive frequency factors "
                              f"(head_dim / 2), not {values.size} values")
    return [float(v) for v in values]


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def tokenizer_files(reader: Any, path: Path, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json from the metadata (transformers' GGUF tokenizer
    builders, plus llama.cpp's pre-tokenizer rules they lack), with BOS/EOS added as the file's
    add_bos_token / add_eos_token say."""
    # deferred: tokenizers and transformers (heavy) load only when a GGUF tokenizer is converted
    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    try:
        arch, tok_dict, tok_config = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot build its tokenizer from the metadata ({e})") from None
    if tok_dict.get("pre_tokenizer_type") in DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokens = tok_dict["tokens"]
    bos_id, eos_id = (_int_or_none(_field(reader, f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos"))
    add_bos = bool(tok_config.get("add_bos_token", False)) and bos_id is not None
    add_eos = bool(tok_config.get("add_eos_token", False)) and eos_id is not None
    single, special = "$A", []
    if add_bos:
        single, special = f"{tokens[bos_id]} {single}", [(tokens[bos_id], bos_id)]
    if add_eos:
        single = f"{single} {tokens[eos_id]}"
        special = list(dict.fromkeys(special + [(tokens[eos_id], eos_id)]))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=special) \
        if special else None
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": add_bos, "add_eos_token": add_eos,
              **{k: v for k, v in tok_config.items() if k.endswith("_token") and v is not None}}
    if tok_config.get("chat_template"):
        config["chat_template"] = tok_config["chat_template"]
    _write_json(out / "tokenizer_config.json", config)


# --- the weights --------------------------------------------------------------------------------
def read_tensors(path: Path, config: dict, blocks: dict | None = None) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 torch tensor) for every tensor of the file, dequantized. With
    `blocks`, the quantized 2-D tensors' raw blocks are kept there too, by name: (type, [rows,
    row bytes] uint8), rows in the order of the dequantized tensor's."""
    # deferred: torch and the gguf package load only when tensors are read
    import torch
    from gguf import GGMLQuantizationType, dequantize
    table = tensor_table(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    unpermute = config.get("model_type") == "llama"
    gemma = config.get("model_type") == "gemma3_text"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in table:
        if t["name"] == ROPE_FREQS:             # in the config (model_config)
            continue
        name = hf_name(t["name"], GEMMA_LAYER_NAMES if gemma else LAYER_NAMES)
        if name is None:
            raise CheckpointError(f"{path}: unexpected tensor {t['name']!r}")
        kind = GGMLQuantizationType(t["type"]).name
        if kind not in TENSOR_TYPES:
            raise CheckpointError(f"{path}: tensor {t['name']!r} has type {kind}, which is not supported "
                                  f"(supported: {', '.join(TENSOR_TYPES)})")
        try:
            data = mapped[t["offset"]:t["offset"] + t["bytes"]].view(np.dtype(t["dtype"])).reshape(t["data_shape"])
            values = np.ascontiguousarray(dequantize(data, t["type"]), dtype=np.float32)
        except Exception as e:
            raise CheckpointError(f"{path}: tensor {t['name']!r} ({kind}) unreadable ({e})") from None
        shape = tuple(int(n) for n in reversed(t["shape"]))
        values = values.reshape(shape)
        if not values.flags.writeable:       # F32 tensors come as views of the read-only mapping
            values = values.copy()
        if gemma and name.endswith("norm.weight"):
            values -= 1          # llama.cpp stores Gemma's scale 1 + w; Hugging Face's weight is w
        permute = unpermute and name.endswith(("q_proj.weight", "k_proj.weight"))
        if permute:
            n = heads if "q_proj" in name else kv_heads
            if len(shape) != 2 or shape[0] % (2 * n):
                raise CheckpointError(f"{path}: tensor {t['name']!r} of shape {list(shape)} does not hold {n} heads "
                                      f"of rotary pairs ({'attention.head_count' if 'q_proj' in name else 'attention.head_count_kv'})")
            values = unpermute_rows(values, n)
        if blocks is not None and kind not in ("F32", "F16", "BF16") and len(shape) == 2:
            raw = np.asarray(data).reshape(shape[0], -1)
            blocks[name] = (kind, unpermute_rows(raw, heads if "q_proj" in name else kv_heads) if permute else raw)
        yield name, torch.from_numpy(values)


def hf_name(name: str, layer_names: dict[str, str] = LAYER_NAMES) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    head, _, rest = name.partition(".")
    if head != "blk":
        return None
    layer, _, part = rest.partition(".")
    if not layer.isdigit() or part not in layer_names:
        return None
    return f"model.layers.{layer}.{layer_names[part]}"


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's rows (its rotary layout pairs
    dimension i with i + 1; Hugging Face's pairs i with i + head_dim / 2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
