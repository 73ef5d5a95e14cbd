"""Structured outputs (sample/grammar.py): the masks against brute force on a tiny vocabulary,
constrained `ar`, and drafting under a constraint token for token against `ar` under it (greedy)
or in distribution (sampled)."""
from __future__ import annotations

import collections
import json

import jsonschema
import pytest
import regex
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.sample.grammar import MAX_DIGIT_RUN, GrammarMatch, apply_bitmask, compiler_for, escape_regex
from leapfrog.sampling_params import ParamError, StructuredOutputs
from leapfrog.tokenizer import Tokenizer
from test_speculative import ENGINE, OracleMethod, assert_greedy_match

SO = StructuredOutputs
SCHEMA = {"type": "object", "properties": {
    "mood": {"enum": ["happy", "sad", "cross"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 2}},
    "required": ["mood", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(llama_dir) -> Tokenizer:
    return Tokenizer.from_folder(llama_dir)


def allowed(match: GrammarMatch, vocab: int) -> set[int]:
    bits = torch.zeros(1, match.words, dtype=torch.int32)
    match.fill(bits[0])
    row = torch.zeros(1, vocab)
    apply_bitmask(row, bits)
    return set(torch.nonzero(row[0] == 0).flatten().tolist())


def brute_force(tok: Tokenizer, prefix: list[int], language: regex.Pattern, vocab: int) -> set[int]:
    """Tokens t such that text(prefix + t) can still be completed into the language; the end
    token where text(prefix) is already in it."""
    text = tok.decode(prefix)
    out = set()
    for t in range(vocab):
        if t in tok.eos_token_ids:
            if language.fullmatch(text):
                out.add(t)
            continue
        piece = tok.decode(prefix + [t])
        if piece == text:           # a special token adds no text: never part of the output
            continue
        if language.fullmatch(piece, partial=True):
            out.add(t)
    return out


@pytest.mark.parametrize("spec,pattern", [
    (SO(regex=r"[a-c]{2,4}x?"), r"[a-c]{2,4}x?"),
    (SO(choice=["cat", "catnip", "dog.", "a+b"]), "|".join(regex.escape(c) for c in ["cat", "catnip", "dog.", "a+b"])),
    (SO(regex=r"\d{2}-\d"), r"[0-9]{2}-[0-9]"),
])
def test_masks_equal_brute_force_over_the_whole_vocabulary(tok, llama_dir, spec, pattern):
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    compiler = compiler_for(tok, vocab)
    language = regex.compile(pattern)
    match = compiler.matcher(spec)
    history: list[int] = []
    # walk one valid path token by token, checking the mask at every step, then roll back
    for _ in range(8):
        want = brute_force(tok, history, language, vocab)
        assert match.sync(history)
        assert allowed(match, vocab) == want, tok.decode(history)
        nexts = sorted(want - set(tok.eos_token_ids))
        if not nexts:
            break
        history = history + [nexts[len(history) % len(nexts)]]
    assert match.sync([])                      # rollback to the start gives the first mask again
    assert allowed(match, vocab) == brute_force(tok, [], language, vocab)


def test_a_draft_path_is_validated_and_rolled_back(tok, llama_dir):
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    match = compiler_for(tok, vocab).matcher(SO(choice=["abc"]))
    ids = tok.encode("abc", add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    assert match.num_valid([], ids + bad + ids) == len(ids)
    assert match.num_valid(ids[:1], ids[1:]) == len(ids) - 1
    assert not match.sync(bad) and match.consumed == []      # the invalid token was never consumed
    assert match.sync(ids) and allowed(match, vocab) == set(tok.eos_token_ids)


@pytest.mark.parametrize("spec", [SO(json=SCHEMA), SO(regex=r"[a-c]{2,4}x?"), SO(choice=["cat", "catnip", "dog."])])
def test_verify_rows_get_the_mask_of_their_own_prefix(tok, llama_dir, spec):
    """Row j of a verify step is masked as the state after drafts[:j] alone would be; rows after
    a draft the constraint rejects are left as they were."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    compiler = compiler_for(tok, vocab)
    match = compiler.matcher(spec)
    gen = torch.Generator().manual_seed(0)
    history: list[int] = []
    for step in range(8):
        assert match.sync(history)
        nexts = sorted(allowed(match, vocab) - set(tok.eos_token_ids))
        if not nexts:
            break
        drafts = [nexts[step % len(nexts)], 0, nexts[0]]
        logits = torch.randn(4, vocab, generator=gen)
        rows = logits.clone()
        match.mask_rows(rows, history, drafts)
        n = 1 + match.num_valid(history, drafts)
        for j in range(4):
            if j < n:
                fresh = compiler.matcher(spec)
                assert fresh.sync(history + drafts[:j])
                ok = allowed(fresh, vocab)
                assert set(torch.isfinite(rows[j]).nonzero().flatten().tolist()) == ok
            else:
                assert torch.equal(rows[j], logits[j])
        history = history + [nexts[step % len(nexts)]]


def test_greedy_verify_takes_the_masked_argmax_where_the_one_token_check_disagrees():
    """On SmolLM2's vocabulary, after `{"name` llguidance's check of one token passes `"` while
    its mask wants `":`. A greedy constrained request verified in the Python path (here beside a
    request with logprobs, which the C++ loop does not serve) must still write what `ar` under
    the mask writes."""
    from test_gguf import smollm2_file
    smollm2_file()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    chat = [[{"role": "user", "content": "Rewrite in the past tense: Once upon a time there was a fox."}],
            [{"role": "user", "content": "Write a haiku about winter."}]]
    params = [SamplingParams(max_tokens=6, temperature=0, structured_outputs=SO(json=schema)),
              SamplingParams(max_tokens=6, temperature=0, logprobs=2)]
    want = LLM("smollm2").chat(chat[:1], params[:1])[0]
    llm = LLM("smollm2", method="ngram")
    quote_colon = llm.engine.tokenizer.encode('":', add_special_tokens=False)
    got = llm.chat(chat, params)[0]
    assert got.token_ids == want.token_ids and quote_colon[0] in want.token_ids, (want.text, got.text)


def _digit_tokens(tok: Tokenizer, vocab: int) -> set[int]:
    return {t for t in range(vocab) if t not in tok.eos_token_ids
            and (text := tok.decode([t])) and all(c in "0123456789" for c in text)}


def test_a_json_digit_run_ends_at_the_cap_where_the_grammar_lets_it(tok, llama_dir):
    """A JSON constraint takes the all-digit tokens away after MAX_DIGIT_RUN digits, only where
    the grammar allows something else (a pattern that wants more digits still gets them);
    other constraint kinds are not capped."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    compiler = compiler_for(tok, vocab)
    digits = _digit_tokens(tok, vocab)
    assert digits
    spec = SO(json={"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    number = compiler.matcher(spec)
    plain = GrammarMatch(compiler.compile(spec).deep_copy(), compiler.vocab_size)    # no cap
    assert compiler.matcher(SO(regex="[0-9]+x?")).digits is None
    pattern = compiler.matcher(SO(json={"type": "string", "pattern": "^[0-9]{30}$"}))
    for run in range(MAX_DIGIT_RUN - 2, MAX_DIGIT_RUN + 3):
        history = tok.encode('{"x": 3.' + "7" * run, add_special_tokens=False)
        assert number.sync(history) and plain.sync(history)
        grammar_allows = allowed(plain, vocab)
        assert grammar_allows & digits and grammar_allows - digits
        if run < MAX_DIGIT_RUN:
            assert allowed(number, vocab) == grammar_allows
        else:
            assert allowed(number, vocab) == grammar_allows - digits
        text = tok.encode('"' + "1" * (run + 1), add_special_tokens=False)
        assert pattern.sync(text) and allowed(pattern, vocab) & digits     # only digits may follow


def test_a_number_the_model_would_write_forever_ends(ar_llm, llama_dir):
    """With every digit pushed up by logit_bias, a JSON number would run to max_tokens; the cap
    ends it, and the reply is valid JSON. Drafting (n-gram drafts copy the digits) gives the
    same tokens."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    tok = ar_llm.engine.tokenizer
    bias = {t: 30.0 for t in _digit_tokens(tok, vocab)}
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0.125, "maximum": 0.5}},
              "required": ["x"], "additionalProperties": False}
    params = SamplingParams(max_tokens=80, temperature=0, logit_bias=bias,
                            structured_outputs=SO(json=schema))
    want = ar_llm.generate(PROMPTS, params)
    for o in want:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    llm = LLM(str(llama_dir), method="ngram", prompt_lookup_min=1, verify="fixed", **ENGINE)
    outs = llm.generate(PROMPTS, params)
    assert_greedy_match(llm.engine.model, outs, [o.token_ids for o in want])
    assert llm.engine.method.stats()["num_verify_steps"] > 0


def test_bad_constraints_name_their_field(tok, llama_dir):
    compiler = compiler_for(tok, 384)
    for spec, text in [(SO(regex="(unclosed", field="guided_regex"), "guided_regex"),
                       (SO(grammar="start: nothing_defined", field="guided_grammar"), "guided_grammar"),
                       (SO(json='{"type": ', field="response_format"), "not valid JSON"),
                       (SO(json={"type": "object", "properties": {"a": {"type": "nosuchtype"}}}), "structured_outputs")]:
        with pytest.raises(ParamError, match=text) as err:
            compiler.compile(spec)
        assert err.value.field == spec.field
    with pytest.raises(ParamError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ParamError, match="at most"):
        SO(grammar="start: " + " | ".join(f'"{i}"' for i in range(20000)))
    assert escape_regex("a.b (c)") == r"a\.b \(c\)"


def test_gbnf_grammars_are_accepted(tok):
    compiler = compiler_for(tok, 384)
    match = compiler.matcher(SO(grammar='root ::= "yes" | "no"'))
    assert match.num_valid([], tok.encode("no", add_special_tokens=False)) == len(tok.encode("no", add_special_tokens=False))


# --- the engine ---------------------------------------------------------------------------------
PROMPTS = ["Once upon a time", "The cat", "A little dog ran"]


def _json_ok(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def ar_llm(llama_dir):
    return LLM(str(llama_dir), **ENGINE)


@pytest.mark.parametrize("spec,check", [
    (SO(json=SCHEMA), _json_ok),
    (SO(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."), lambda t: regex.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,3}\.", t)),
    (SO(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
])
def test_ar_outputs_conform(ar_llm, spec, check):
    outs = ar_llm.generate(PROMPTS, SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec))
    outs += ar_llm.generate(PROMPTS, SamplingParams(max_tokens=80, temperature=1.0, seed=1, structured_outputs=spec))
    for o in outs:
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_constrained_and_free_requests_share_a_batch(ar_llm):
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in ar_llm.generate(PROMPTS, free)]
    params = [free, SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(json=SCHEMA)), free]
    outs = ar_llm.generate(PROMPTS, params)
    assert outs[0].token_ids == want[0] and outs[2].token_ids == want[2]
    assert _json_ok(outs[1].text)


GREEDY_SO = [SO(json=SCHEMA), SO(regex=r"(the|a) [a-z ]{3,30}\.")]


@pytest.mark.parametrize("method", ["oracle", "draft", "ngram"])
def test_greedy_drafting_under_a_constraint_equals_ar_under_it(llama_dir, draft_dir, ar_llm, method, monkeypatch):
    import leapfrog.engine.llm_engine
    if method == "oracle":            # drafts the unconstrained argmax: the constraint cuts them
        monkeypatch.setattr(leapfrog.engine.llm_engine, "method_class", lambda name: OracleMethod)
        llm = LLM(str(llama_dir), method="oracle", num_speculative_tokens=4, **ENGINE)
    elif method == "draft":
        llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=4, **ENGINE)
    else:
        llm = LLM(str(llama_dir), method="ngram", prompt_lookup_min=1, verify="fixed", **ENGINE)
    for spec in GREEDY_SO:
        params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=spec)
        want = ar_llm.generate(PROMPTS, params)
        outs = llm.generate(PROMPTS, params)
        assert_greedy_match(llm.engine.model, outs, [o.token_ids for o in want])
    stats = llm.engine.method.stats()
    assert stats["num_verify_steps"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_sampled_drafting_under_a_constraint_keeps_ars_distribution(llama_dir, draft_dir, ar_llm):
    """Over many seeds, the outputs' distribution with drafting equals ar's (total variation
    within sampling noise), and every output conforms."""
    spec = SO(regex="[ab]{3}")
    n = 400
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, structured_outputs=spec) for s in range(n)]
    want = collections.Counter(o.text for o in ar_llm.generate(["Once upon"] * n, params))
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=3, **ENGINE)
    got = collections.Counter(o.text for o in llm.generate(["Once upon"] * n, params))
    assert all(regex.fullmatch("[ab]{3}", t) for t in got)
    tv = sum(abs(got[k] - want[k]) for k in set(got) | set(want)) / (2 * n)
    assert tv < 0.12, (want, got)
    assert llm.engine.method.stats()["num_verify_steps"] > 0


def test_the_decode_loop_masks_as_the_python_sampler_does(llama_dir, monkeypatch):
    """Constrained rows sample inside the C++ decode loop (their masks filled by a callback
    before each step); the tokens equal the one-step path's, greedy and seeded."""
    import leapfrog.engine.decode_loop as dl
    from leapfrog.layers.cpu_kernels import cpu_kernels
    if cpu_kernels() is None:
        pytest.skip("no C++ kernels")
    llm = LLM(str(llama_dir), **ENGINE)
    params = [SamplingParams(max_tokens=40, temperature=t, seed=5, structured_outputs=spec)
              for t in (0, 0.9) for spec in (SO(json=SCHEMA), SO(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,5}\."))]
    prompts = PROMPTS[:2] * 2
    calls = []
    original = dl.LoopMasks.__call__
    monkeypatch.setattr(dl.LoopMasks, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    looped = llm.generate(prompts, params)
    assert calls, "the loop never asked for masks"
    monkeypatch.setattr(dl, "eligible", lambda seq: seq.params.structured_outputs is None)
    stepped = LLM(str(llama_dir), **ENGINE).generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in stepped]


def test_ignore_eos_after_the_constraint_ends_gives_end_tokens_on_every_path(llama_dir, monkeypatch):
    """With ignore_eos a constrained request runs to max_tokens; once the constraint has ended,
    its mask allows only the end tokens, so the text stays the constrained text, and the C++
    loop and the one-step path (where a step is shared with arriving prompts) agree."""
    import leapfrog.engine.decode_loop as dl
    llm = LLM(str(llama_dir), **ENGINE)
    eos = set(llm.engine.scheduler.eos_token_ids)
    specs = (SO(choice=["yes", "no"]), SO(json={"type": "integer", "minimum": 0, "maximum": 99}), SO(regex=r"[a-z]{2,4}"))
    params = [SamplingParams(max_tokens=24, temperature=t, seed=2, ignore_eos=True, structured_outputs=s)
              for t in (0, 0.9) for s in specs]
    prompts = (PROMPTS * 2)[:len(params)]
    looped = llm.generate(prompts, params)
    monkeypatch.setattr(dl, "eligible", lambda seq: False)
    stepped = LLM(str(llama_dir), **ENGINE).generate(prompts, params)
    for a, b, p in zip(looped, stepped, params):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 24
        end = next((i for i, t in enumerate(a.token_ids) if t in eos), None)
        assert end is not None, (p.structured_outputs, a.text, a.token_ids)
        assert set(a.token_ids[end:]) <= eos, a.token_ids
        assert a.finish_reason == "length"


# --- defects: a constraint never silently dropped -----------------------------------------------
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}   # compiles, fails decoding


def test_a_schema_whose_first_mask_fails_is_refused_when_compiled(tok):
    loop = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(ParamError, match="cannot be compiled") as err:
        compiler_for(tok, 384).compile(SO(json=loop, field="guided_json"))
    assert err.value.field == "guided_json"


def test_a_constraint_past_the_engines_limits_fails_its_request_alone(ar_llm):
    """A grammar that goes past llguidance's limits while decoding ends its request with an
    error naming the field (the server's 400), never with unconstrained text; the requests
    beside it go on as without it, in the C++ loop and in the one-step path alike."""
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in ar_llm.generate(PROMPTS, free)]
    wide = SamplingParams(max_tokens=16, temperature=0, structured_outputs=SO(json=WIDE, field="guided_json"))
    for params in ([free, wide, free], [free, SamplingParams(max_tokens=16, temperature=0, logprobs=1,
                                                              structured_outputs=wide.structured_outputs), free]):
        outs = ar_llm.generate(PROMPTS, params)
        assert outs[1].finish_reason.startswith("error:param:guided_json:"), outs[1].finish_reason
        assert "limits" in outs[1].finish_reason
        assert outs[0].token_ids == want[0] and outs[2].token_ids == want[2]


def test_bad_words_never_take_a_constraint_away(ar_llm, tok):
    """bad_words that ban every token the constraint allows leave the constraint the tokens it
    allows (it wins, as it does over min_tokens)."""
    words = ["yes", "no", "maybe"]
    for t in (0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=t, seed=4, bad_words=words,
                                structured_outputs=SO(choice=words))
        for o in ar_llm.generate(PROMPTS, params):
            assert o.finish_reason == "stop" and o.text in words, o.text
    # a ban that leaves some allowed tokens still bans ("y" is one token of this vocabulary)
    assert len(tok.encode("y", add_special_tokens=False)) == 1
    params = SamplingParams(max_tokens=12, temperature=0, bad_words=["y"], structured_outputs=SO(choice=words))
    for o in ar_llm.generate(PROMPTS, params):
        assert o.text in ("no", "maybe"), o.text


def test_property_order_is_the_schemas_own(ar_llm):
    """Two schemas that differ only in property order are two grammars (the compile cache keys
    them as written), so each reply writes its keys in its own schema's order."""
    for order in (["first", "second"], ["second", "first"]):
        schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in order},
                  "required": ["first", "second"], "additionalProperties": False}
        out = ar_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0,
                                                          structured_outputs=SO(json=schema)))[0]
        assert list(json.loads(out.text)) == order, out.text


def test_a_constraint_the_vocabulary_cannot_spell_fails_naming_its_field():
    """`couplets` reads Chinese characters only (a SentencePiece vocabulary with <unk>): "yes"
    begins but cannot go on, and JSON cannot begin. Special tokens never stand in for the text
    (llguidance lets <unk> spell what the vocabulary cannot), so the request fails with its
    field named (the server's 400) instead of sampling a token its own constraint rejects."""
    llm = LLM("couplets")
    out = llm.generate(["春"], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["yes", "no"],
                                                                                  field="guided_choice")))[0]
    assert out.finish_reason.startswith("error:param:guided_choice:") and "no token" in out.finish_reason
    compiler = compiler_for(llm.engine.tokenizer, llm.engine.hf_config["vocab_size"])
    with pytest.raises(ParamError, match="begins") as err:
        compiler.compile(SO(json_object=True, field="response_format"))
    assert err.value.field == "response_format"
    spelled = llm.generate(["春"], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[春夏]{2}")))[0]
    assert spelled.finish_reason == "stop" and len(spelled.text) == 2
