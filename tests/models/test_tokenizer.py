"""leapfrog.tokenizer against transformers' AutoTokenizer on tiny tokenizers built here.

One SentencePiece BPE model (byte fallback, so characters it never saw become byte tokens) is
trained on generated English + Chinese text; folder "sp" holds it as tokenizer.model, folder
"json" is what transformers writes from it (tokenizer.json, chat_template.jinja). A third folder
holds a GPT-2/Qwen-style byte-level BPE tokenizer.json. Oracles: transformers' encode, decode and
apply_chat_template; the full decode for the streaming detokenizer.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from leapfrog.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog hello world model token engine speed fast".split()
HANZI = "春节快乐万事如意龙年大吉恭喜发财天下太平山水风月花鸟人间"
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + m['role']) }}\n"
    "  {% endif %}\n"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}"
)
TEXTS = [
    "hello world",
    " leading space",
    "trailing spaces  ",
    "two  spaces\tand\ttabs",
    "line\nbreak\n\nend",
    "春节快乐，万事如意",
    "龍年 😀 emoji 🐉🐉",
    "mixed 中文 and English 123",
    "naïve café",
    "",
    " ",
    "<s>inline special</s> and <mask> too",
]
MESSAGES = [
    {"role": "system", "content": "You write couplets."},
    {"role": "user", "content": "春节快乐 "},
    {"role": "assistant", "content": "万事如意"},
    {"role": "user", "content": "one more, 龍 😀"},
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(8)))
        lines.append("".join(rng.choice(HANZI) for _ in range(10)))
    return lines


def _tokenizer_config(**extra) -> dict:
    eos = {"__type": "AddedToken", "content": "</s>", "special": True, "lstrip": False,
           "rstrip": False, "normalized": False, "single_word": False}
    return {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": eos,
            "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": True,
            "add_eos_token": False, "chat_template": TEMPLATE, **extra}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    sp_dir, json_dir = root / "sp", root / "json"
    sp_dir.mkdir()
    (root / "corpus.txt").write_text("\n".join(_corpus()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(sp_dir / "tokenizer"), model_type="bpe",
        vocab_size=400, byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, user_defined_symbols=["<mask>"], normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2,
    )
    (sp_dir / "tokenizer.vocab").unlink()
    (sp_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config()))
    (sp_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (sp_dir / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    transformers.AutoTokenizer.from_pretrained(sp_dir).save_pretrained(json_dir)
    assert (json_dir / "tokenizer.json").is_file()
    return {"sp": sp_dir, "json": json_dir, "bytelevel": _byte_level_folder(root / "bytelevel")}


def _byte_level_folder(folder: Path) -> Path:
    """A GPT-2/Qwen-style byte-level BPE tokenizer.json: tokens may hold part of a character."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir()
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["sp", "json", "bytelevel"])
def pair(request, folders):
    """(ours, transformers') for one folder."""
    folder = folders[request.param]
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)


def test_backend_choice(folders):
    assert type(Tokenizer.from_folder(folders["sp"])._backend).__name__ == "_SPBackend"
    assert type(Tokenizer.from_folder(folders["json"])._backend).__name__ == "_HFBackend"
    # transformers 5 moves the template out of tokenizer_config.json into its own file
    assert (folders["json"] / "chat_template.jinja").is_file()


def test_byte_fallback_is_exercised(pair):
    ours, _ = pair
    ids = ours.encode("龍 😀", add_special_tokens=False)
    # some token decodes to part of a character
    assert any(ours.decode([i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(pair, skip):
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_special_ids_match_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert set(hf.all_special_ids) <= ours.special_token_ids
    assert ours.token_to_id("no such token") is None
    if hf.mask_token_id is not None:
        assert ours.mask_token_id == hf.mask_token_id == ours.token_to_id("<mask>")
    else:  # no mask_token in the config: found by name
        assert ours.mask_token_id == ours.token_to_id("<|mask|>") is not None
    assert ours.id_to_token(ours.eos_token_ids[0]) in ("</s>", "<|im_end|>")
    with pytest.raises(IndexError):
        ours.id_to_token(10**6)


def test_eos_union_from_config_files(folders):
    # tokenizer_config eos (2), generation_config [2, 3], config.json 2: de-duplicated, order kept
    assert Tokenizer.from_folder(folders["sp"]).eos_token_ids == [2, 3]
    assert Tokenizer.from_folder(folders["json"]).eos_token_ids == [2]


def test_chat_template_matches_transformers(pair):
    ours, hf = pair
    assert ours.has_chat_template
    for gen in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template(MESSAGES)
    assert ours.encode(rendered, add_special_tokens=False) == hf.encode(rendered, add_special_tokens=False)


def test_chat_template_errors(folders, tmp_path):
    ours = Tokenizer.from_folder(folders["sp"])
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    _copy_sp(folders, tmp_path, _tokenizer_config(chat_template=None))
    bare = Tokenizer.from_folder(tmp_path)
    assert not bare.has_chat_template
    with pytest.raises(ValueError, match="model has no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_a_developer_message_is_the_system_message_to_a_template_without_that_role(folders, tmp_path):
    """OpenAI's SDK sends instructions as role `developer`; a template that never names it reads
    them as its system message (llama-server's rendering), one that does gets them as sent."""
    ours = Tokenizer.from_folder(folders["sp"])
    as_system = ours.apply_chat_template([{"role": "system", "content": "Be brief."}, *MESSAGES[1:]])
    assert ours.apply_chat_template([{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]) == as_system
    aware = "{% for m in messages %}[{{ m.role }}{% if m.role == 'developer' %}!{% endif %}]{{ m.content }}{% endfor %}"
    _copy_sp(folders, tmp_path, _tokenizer_config(chat_template=aware))
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(
        [{"role": "developer", "content": "x"}], add_generation_prompt=False) == "[developer!]x"


def test_chat_template_list_form_uses_default(folders, tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": TEMPLATE}]
    _copy_sp(folders, tmp_path, _tokenizer_config(chat_template=templates))
    listed = Tokenizer.from_folder(tmp_path)
    expected = Tokenizer.from_folder(folders["sp"]).apply_chat_template(MESSAGES)
    assert listed.apply_chat_template(MESSAGES) == expected


def _copy_sp(folders, dest: Path, config: dict) -> None:
    (dest / "tokenizer.model").write_bytes((folders["sp"] / "tokenizer.model").read_bytes())
    (dest / "tokenizer_config.json").write_text(json.dumps(config))


def test_dict_specials_and_added_tokens(folders, tmp_path):
    config = _tokenizer_config(bos_token={"content": "<s>", "special": True}, mask_token=None)
    config["added_tokens_decoder"] = {"400": {"content": "<|im_end|>", "special": True}}
    _copy_sp(folders, tmp_path, config)
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.bos_token_id == 1 and tok.vocab_size == 401
    assert tok.mask_token_id == tok.token_to_id("<mask>")  # found by name
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 400 and 400 in tok.special_token_ids
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], step: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("step", [1, 3])
def test_incremental_equals_full_decode(pair, step):
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        pieces = _stream(ours, [], ids, step)
        assert "".join(pieces) == ours.decode(ids), text
        for piece in pieces:
            assert "\ufffd" not in piece, (text, pieces)
            piece.encode("utf-8")  # no lone surrogates: valid UTF-8


def test_incremental_with_prompt_context(pair):
    ours, _ = pair
    # Split one encoded text at every point where the prompt decodes to complete characters;
    # some points leave the prompt's last few ids in the middle of a byte-fallback run.
    full = ours.encode("春节 prompt 龍😀龍年 x 🐉 hello")
    whole = ours.decode(full)
    for k in range(1, len(full)):
        head = ours.decode(full[:k])
        if head.endswith("\ufffd"):
            continue
        assert whole.startswith(head)
        pieces = _stream(ours, full[:k], full[k:])
        assert "".join(pieces) == whole[len(head) :], k
        assert all("\ufffd" not in p for p in pieces), (k, pieces)


def test_incremental_holds_back_partial_character_until_flush(pair):
    ours, _ = pair
    ids = ours.encode("龍", add_special_tokens=False)
    assert len(ids) > 1  # byte fallback: one token per UTF-8 byte
    detok = IncrementalDetokenizer(ours, [])
    assert detok.add(ids[:-1]) == ""
    assert detok.flush().endswith("\ufffd")  # incomplete, emitted anyway at the end


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", "{not json"),
    ("tokenizer.model", "this is not a sentencepiece model"),
])
def test_corrupt_tokenizer_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_folder(tmp_path)


def test_corrupt_config(folders, tmp_path):
    _copy_sp(folders, tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path)


def test_add_all_equals_id_by_id(pair):
    """add_all (a finished offline request's output in one decode) returns what add() does id
    by id, with and without prompt context, for whole texts, texts cut mid-character and random
    ids (byte-fallback runs included); flush afterwards agrees too."""
    import random

    ours, _ = pair
    rng = random.Random(0)
    cases = []
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        cases += [([], ids), (ids[:3], ids[3:]), ([], ids[:-1])]
    cases += [([rng.randrange(ours.vocab_size) for _ in range(rng.randrange(6))],
               [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(30))]) for _ in range(200)]
    for prompt, ids in cases:
        a, b = IncrementalDetokenizer(ours, prompt), IncrementalDetokenizer(ours, prompt)
        assert (a.add(ids), a.flush()) == (b.add_all(ids), b.flush()), (prompt, ids)
        assert a.text == b.text
