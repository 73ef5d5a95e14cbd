"""Engine behaviour on a tiny real checkpoint: streaming, stops, seeds, preemption, abort."""
from __future__ import annotations

from dataclasses import replace

import subprocess
import sys

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.tokenizer import encode_chat

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The cat liked to play in the sun. One day",
           "春回大地", "They became friends and"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=4)


def drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_streamed_deltas_equal_offline_text(llama_dir, llm):
    offline = llm.generate(PROMPTS, GREEDY)
    engine = LLMEngine(str(llama_dir), block_size=4)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, request_id=str(i))
    streams = drain(engine)
    for i, off in enumerate(offline):
        parts = streams[str(i)]
        assert "".join(o.delta_text for o in parts) == off.text == parts[-1].text
        assert sum(len(o.delta_token_ids) for o in parts) == len(off.token_ids) == 16
        assert parts[-1].finished and not any(o.finished for o in parts[:-1])


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate(["Once upon a time"], GREEDY)[0]
    assert len(base.text) > 4
    stop = base.text[2:4]
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.index(stop)]
    out = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=16, temperature=0, stop=[stop], include_stop_str_in_output=True))[0]
    assert out.text.endswith(stop)
    tokenizer = llm.engine.tokenizer
    shown = lambda ids: tokenizer.decode(ids).rstrip("\ufffd")     # noqa: E731 - whole characters only
    # a stop token that adds text of its own where it first comes
    tok = next(t for i, t in enumerate(base.token_ids) if i >= 2 and base.token_ids.index(t) == i
               and len(shown(base.token_ids[:i + 1])) > len(shown(base.token_ids[:i])))
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]
    # the stop token stays in token_ids, its text only with include_stop_str_in_output (vLLM's rule)
    assert out.text == shown(out.token_ids[:-1]), (out.text, out.token_ids)
    kept = llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tok],
                                                             include_stop_str_in_output=True))[0]
    assert kept.token_ids == out.token_ids and kept.text == shown(out.token_ids) != out.text
    for stop in ([], [base.text[-3:]]):        # one token at a time, and through the stop-string path
        engine = llm.engine
        engine.add_request("Once upon a time", SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[tok],
                                                              stop=stop), request_id=f"stream-{len(stop)}")
        parts = drain(engine)[f"stream-{len(stop)}"]
        assert "".join(o.delta_text for o in parts) == out.text == parts[-1].text


def test_max_tokens_that_cut_a_character_leave_it_out(llama_dir, llm):
    """Where max_tokens ends a reply inside a multi-byte character, the text holds the whole
    characters only (vLLM's), streamed and offline alike."""
    base = llm.generate(["Once upon a time"], GREEDY)[0]
    tokenizer = llm.engine.tokenizer
    cuts = [n for n in range(1, len(base.token_ids)) if tokenizer.decode(base.token_ids[:n]).endswith("\ufffd")]
    assert cuts, "no cut inside a character in this output"
    engine = LLMEngine(str(llama_dir), block_size=4)
    for n in cuts[:3]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        out = llm.generate(["Once upon a time"], params)[0]
        assert out.finish_reason == "length" and out.token_ids == base.token_ids[:n]
        assert out.text == tokenizer.decode(base.token_ids[:n]).rstrip("\ufffd")
        engine.add_request("Once upon a time", params, request_id=str(n))
        parts = drain(engine)[str(n)]
        assert "".join(o.delta_text for o in parts) == out.text


def test_min_tokens_delays_stop_tokens(llm):
    """With min_tokens, a stop token id cannot end the request early: the output follows the
    greedy one up to where that token first came, then continues without it until min_tokens."""
    base = llm.generate(["Once upon a time"], GREEDY)[0]
    tok = base.token_ids[2]
    first = base.token_ids.index(tok)
    out = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=16, temperature=0, stop_token_ids=[tok], min_tokens=10))[0]
    assert out.token_ids[:first] == base.token_ids[:first]
    assert tok not in out.token_ids[:10] and len(out.token_ids) >= 10


def test_min_tokens_delays_stop_strings_as_vllm_does(llm):
    """A stop string ending within the first min_tokens tokens' text does not count (vLLM's
    rule); the first one ending after it cuts the text, as without min_tokens."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = llm.generate(["Once upon a time"], params)[0]
    tok = llm.engine.tokenizer
    within = len(tok.decode(base.token_ids[:8]))           # the text of the first 8 tokens
    assert within >= 2
    stop = base.text[:2]                                    # a string that ends inside it
    cut = llm.generate(["Once upon a time"], replace(params, stop=[stop]))[0]
    assert (cut.finish_reason, cut.text) == ("stop", "")
    held = llm.generate(["Once upon a time"], replace(params, stop=[stop], min_tokens=8))[0]
    assert held.token_ids[:8] == base.token_ids[:8]
    later = base.text.find(stop, within - len(stop) + 1)   # the first one ending past those 8 tokens
    if later >= 0:
        assert (held.finish_reason, held.text) == ("stop", base.text[:later])
    else:
        assert (held.finish_reason, held.text) == ("length", base.text)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(["Once upon a time"], p)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0)
    mixed = llm.generate(PROMPTS[1:] + ["Once upon a time"], [others] * 3 + [p])[3].token_ids
    assert alone == mixed
    assert llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=1.0, seed=99))[0].token_ids != alone


def test_preemption_and_recompute_keep_results(llama_dir, llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    tight = LLM(str(llama_dir), block_size=4, kv_cache_tokens=48, enable_prefix_caching=False)
    got = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks == 0


def test_priority_classes_are_served_first(llama_dir):
    engine = LLMEngine(str(llama_dir), max_batch_size=1)
    for name, prio in (("low", 5), ("high", 0), ("mid", 1)):
        engine.add_request("Once upon", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                           request_id=name, priority=prio)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_a_bfloat16_kv_cache_on_a_cpu_says_it_leaves_the_kernels(llama_dir, caplog):
    """The CPU kernels read float32 and float16 caches; a bfloat16 one still decodes (through
    torch) and the log says why it is slower."""
    import logging
    with caplog.at_level(logging.WARNING, logger="leapfrog"):
        llm = LLM(str(llama_dir), kv_cache_dtype="bfloat16")
    assert any("kv_cache_dtype=bfloat16" in r.getMessage() for r in caplog.records)
    out = llm.generate(["Once upon"], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens


def test_abort_frees_kv_blocks(llama_dir):
    engine = LLMEngine(str(llama_dir), block_size=4)
    engine.add_request("Once upon a time", SamplingParams(max_tokens=50, temperature=0), request_id="a")
    engine.add_request("The cat", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), request_id="b")
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort("a") and not engine.abort("a")
    drain(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_logprobs_and_metrics(llm):
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp["token_id"] == tok and lp["top"][0][0] == tok and len(lp["top"]) == 3
    m = out.metrics
    assert m.num_output_tokens == 5 and m.num_forwards == 5 and m.tokens_per_forward == 1.0
    assert m.time_to_first_token is not None and m.total_time >= m.time_to_first_token


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate(["word " * 400], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="unknown option"):
        LLM(str(llm.engine.model_path), no_such_option=1)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="not valid Unicode"):     # bytes that were not UTF-8 (a shell's surrogates)
        llm.generate(["caf\udce9"], GREEDY)
    # without chunked prefill a prompt is one step: a budget under the context would never run it
    with pytest.raises(ValueError, match="chunked_prefill off"):
        LLM(str(llm.engine.model_path), chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(FileNotFoundError, match="the name is empty"):     # Path("") was the current folder
        LLM("")
    with pytest.raises(ValueError, match="draft_model='stories': method 'ar' reads no draft model"):
        LLM(str(llm.engine.model_path), method="ar", draft_model="stories")
    from leapfrog.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_bytes=4096: and kv_cache_tokens=64 both size the KV cache"):
        EngineConfig(kv_cache_tokens=64, kv_cache_bytes=4096).validate()
    for name in ("block_size", "max_batch_size", "kv_cache_tokens", "kv_spill_bytes"):   # True is no count
        with pytest.raises(ValueError, match=f"engine option {name}=True"):
            EngineConfig(**{name: True}).validate()


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids[:1] == [1]


def test_vllms_offline_api_runs_as_written(llm):
    """vLLM's quickstart: generate(prompts, sampling_params=...), output.outputs[0].text, n
    completions (choice j seeded with seed + j), its prompt dicts, max_tokens=None, get_tokenizer
    and chat's keywords."""
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3, logprobs=0)
    outs = llm.generate(PROMPTS[:2], sampling_params=sp)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    first = outs[0].outputs
    assert first[0].text == outs[0].text and [c.index for c in first] == [0, 1, 2]
    for j, c in enumerate(first):     # choice j is the seeded request with seed + j
        alone = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.8, seed=3 + j, logprobs=0))[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
        assert c.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in alone.logprobs))
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_ids, by_text = llm.generate([{"prompt_token_ids": ids}, {"prompt": PROMPTS[0]}], GREEDY)
    assert by_ids.token_ids == by_text.token_ids == llm.generate(PROMPTS[0], params=GREEDY)[0].token_ids
    with pytest.raises(TypeError, match="prompt 0: a prompt dict holds either"):
        llm.generate({"text": "x"}, GREEDY)
    # vLLM's None defaults of the list and dict fields
    none = SamplingParams(max_tokens=4, temperature=0, stop=None, stop_token_ids=None, bad_words=None,
                          logits_processors=None, logit_bias=None)
    assert (none.stop, none.stop_token_ids, none.bad_words, none.logits_processors, none.logit_bias) == ([],) * 4 + ({},)
    long = llm.generate(ids, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(ids) + len(long.token_ids) == llm.engine.max_model_len and long.finish_reason == "length"
    with pytest.raises(ValueError, match="n=2: the engine takes one sequence a request"):
        llm.engine.add_request("hi", SamplingParams(n=2))
    with pytest.raises(ValueError, match="n=0: must be between 1 and"):
        SamplingParams(n=0)
    assert not llm.engine.has_unfinished()


def test_chat_continues_a_final_message_and_hands_kwargs_to_the_template(llm, monkeypatch):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    out = llm.chat(conv, sampling_params=SamplingParams(max_tokens=2, temperature=0),
                   add_generation_prompt=False, continue_final_message=True)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.rstrip().endswith("Once upon") and out.prompt.endswith("Once upon")
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        llm.chat(conv, continue_final_message=True)
    seen, rendered = {}, []
    original = llm.tokenizer.apply_chat_template
    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", lambda m, add_generation_prompt=True, **kw:
                        seen.update(kw) or rendered.append(m) or original(m, add_generation_prompt))
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    for reads in (True, False):             # a template that reads tools gets them; else Hermes's system block
        monkeypatch.setattr(llm.tokenizer, "template_reads_tools", reads)
        seen.clear()
        if reads:
            llm.chat(conv[:1], SamplingParams(max_tokens=1), tools=[tool], chat_template_kwargs={"x": 1})
        else:                               # (the block is longer than this test model's context)
            with pytest.raises(ValueError, match="context"):
                llm.chat(conv[:1], SamplingParams(max_tokens=1), tools=[tool], chat_template_kwargs={"x": 1})
        assert seen == ({"tools": [tool], "x": 1} if reads else {"x": 1})
        assert reads or ('"name": "get_time"' in rendered[-1][0]["content"] and rendered[-1][0]["role"] == "system")
    monkeypatch.setattr(llm.tokenizer, "template_reads_tools", True)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv[:1], chat_template_kwargs={"add_generation_prompt": False})
    # OpenAI's text parts, and a tool-calling turn without content, as the server takes them
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    llm.chat(parts, SamplingParams(max_tokens=1), tools=[tool])
    assert [m["content"] for m in rendered[-1]] == ["h\ni", "", "noon"] and rendered[-1][1]["tool_calls"]
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_chat_template_of_ones_own_replaces_the_models(llama_dir, tmp_path):
    """chat_template (vLLM's --chat-template): a file or the Jinja text; a broken one or a path
    that is not there is named before the weights load."""
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        llm = LLM(str(llama_dir), chat_template=given)
        assert llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<a>"
    with pytest.raises(ValueError, match="chat template has a syntax error"):
        LLM(str(llama_dir), chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        LLM(str(llama_dir), chat_template=str(tmp_path / "missing.jinja"))


def test_get_tokenizer_answers_as_a_hugging_face_tokenizer(llm):
    """vLLM's llm.get_tokenizer() is a Hugging Face tokenizer: code written for it gets its
    defaults (apply_chat_template tokenizes and adds no generation prompt; decode keeps special
    tokens) and its calls."""
    tok, inner = llm.get_tokenizer(), llm.tokenizer
    conv = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text == inner.apply_chat_template(conv, add_generation_prompt=False)
    assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == inner.apply_chat_template(conv)
    assert tok.apply_chat_template(conv) == encode_chat(inner, text)
    ids = tok("Once upon a time")["input_ids"]
    assert ids == inner.encode("Once upon a time") and tok(["a", "b"])["input_ids"] == [tok.encode("a"), tok.encode("b")]
    with_special = [inner.bos_token_id, *ids[1:]] if inner.bos_token_id is not None else ids
    assert tok.decode(with_special) == inner.decode(with_special, skip_special_tokens=False)
    assert tok.decode(with_special, skip_special_tokens=True) == inner.decode(with_special)
    assert tok.batch_decode([ids, ids]) == [tok.decode(ids)] * 2 and tok.decode(ids[1]) == tok.decode([ids[1]])
    assert tok.convert_ids_to_tokens(ids[1]) == inner.id_to_token(ids[1])
    assert tok.eos_token_id == inner.eos_token_ids[0] and len(tok) == inner.vocab_size
    assert tok.vocab_size == inner.vocab_size          # the rest is the Tokenizer's own


def test_bad_words_are_never_written():
    """vLLM's bad_words on `stories` (a model that writes "the" in every sentence): each word's
    token sequences (as written and after a space) never appear in the output, which otherwise
    holds them; the other words keep being written."""
    from leapfrog.engine.llm_engine import bad_words_ids
    llm = LLM("stories")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    free = llm.generate(PROMPTS[:2], params)
    banned = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                                       bad_words=["the", "and"]))
    seqs = bad_words_ids(llm.tokenizer, ["the", "and"])

    def holds(ids, w):
        return any(ids[i:i + len(w)] == w for i in range(len(ids) - len(w) + 1))
    assert any(holds(o.token_ids, w) for o in free for w in seqs)
    assert not any(holds(o.token_ids, w) for o in banned for w in seqs)
    assert all(len(o.token_ids) == 48 for o in banned)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_block_diffusion_never_writes_a_bad_word_either():
    """Block diffusion decides several positions in a step; a token that completes a bad word
    after positions decided beside it is taken back and decided again once the text before it
    is committed, so multi-token bad words are never written."""
    from leapfrog.engine.llm_engine import bad_words_ids
    words = ["loved to", "there was", "wanted to", "One day"]
    llm = LLM("stories-diffusion-plain", method="diffusion", threshold=0.5)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    free = llm.generate(PROMPTS[:3], params)
    banned = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, bad_words=words))
    seqs = [w for w in bad_words_ids(llm.tokenizer, words) if len(w) > 1]

    def holds(ids, w):
        return any(ids[i:i + len(w)] == w for i in range(len(ids) - len(w) + 1))
    assert any(holds(o.token_ids, w) for o in free for w in seqs)
    assert not any(holds(o.token_ids, w) for o in banned for w in seqs)
    assert all(len(o.token_ids) == 48 for o in banned)


def test_cli_generate_writes_only_text_to_stdout(llama_dir, llm):
    want = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir),
                           "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--stats",
                           "Once upon a time"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    assert "tok/s" in proc.stderr
    # a bad option value is refused by name, 0 threads included (not read as "the default")
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir),
                           "--num-threads", "0", "Once"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "num_threads=0" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir),
                           "--option", "block_size", "Once"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected KEY=VALUE" in proc.stderr and "Traceback" not in proc.stderr
    # a request that fails in the engine says so and does not exit 0
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir),
                           "--option", "kv_cache_tokens=16", "--option", "block_size=4", "--max-tokens", "64",
                           "--ignore-eos", "Once upon a time"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "error:kv_cache_too_small" in proc.stderr, (proc.returncode, proc.stderr)


def test_bf16_on_cpu_tracks_fp32(llama_dir):
    import torch

    from leapfrog.models.loader import load_model
    ids = torch.tensor([[1, 5, 9, 30, 31, 32, 33]])
    full = load_model(llama_dir).forward_dense(ids)
    half = load_model(llama_dir, dtype=torch.bfloat16).forward_dense(ids)
    assert half.dtype == torch.float32                     # logits are always returned in fp32
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    out = LLM(str(llama_dir), dtype="bfloat16").generate(["Once upon"], GREEDY)[0]
    assert out.metrics.num_output_tokens == 16


def test_a_method_needs_only_prepare_and_commit(llama_dir, llm, monkeypatch):
    """The engine, scheduler and runner ask a method only for what methods/base.Method
    declares, each member with a default: a subclass that implements prepare() and commit()
    alone decodes (here it delegates to ar's, so the output is ar's)."""
    import leapfrog.engine.llm_engine
    from leapfrog.methods.autoregressive import AutoregressiveMethod
    from leapfrog.methods.base import Method

    class Minimal(Method):
        def __init__(self, ctx, **options) -> None:
            self.inner = AutoregressiveMethod(ctx)

        def prepare(self, batch) -> None:
            self.inner.prepare(batch)

        def commit(self, batch, out):
            return self.inner.commit(batch, out)

    monkeypatch.setattr(leapfrog.engine.llm_engine, "method_class", lambda name: Minimal)
    minimal = LLM(str(llama_dir), method="minimal", block_size=4)
    outs = minimal.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(o.metrics.acceptance_length is None for o in outs)
    assert minimal.engine.method.stats() == {}


def test_no_module_imports_another_modules_private_names():
    """`from leapfrog.x import _name` (or `import leapfrog.x._y`) inside the package: a name
    another module needs is public there."""
    import ast
    from pathlib import Path

    import leapfrog
    root = Path(leapfrog.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leapfrog"):
                bad += [f"{path.relative_to(root)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Import):
                bad += [f"{path.relative_to(root)}: {a.name}" for a in node.names
                        if a.name.startswith("leapfrog") and any(p.startswith("_") for p in a.name.split("."))]
    assert not bad, bad


def test_a_request_whose_output_fails_fails_alone(llm, monkeypatch):
    """An error while emitting one request's text (its detokenizer raising) finishes that
    request with an error; the request next to it decodes as it would alone."""
    want = llm.generate(["The little dog"], GREEDY)[0]
    eng = llm.engine
    bad = eng.add_request("Once upon a time", GREEDY, "bad")
    eng.add_request("The little dog", GREEDY, "good")
    monkeypatch.setattr(eng.requests[bad].detok, "add", lambda ids: (_ for _ in ()).throw(RuntimeError("boom")))
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "error:RuntimeError: boom"
    assert final["good"].token_ids == want.token_ids and final["good"].text == want.text
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps"])
def test_a_device_this_machine_lacks_is_a_configuration_error(llama_dir, device):
    # device="cuda" on a CPU-only torch once failed inside torch with a bare AssertionError
    import torch
    from leapfrog.config import EngineConfig
    present = {"cuda": torch.cuda.is_available(), "cuda:7": torch.cuda.device_count() > 7,
               "mps": torch.backends.mps.is_available()}[device]
    if present:
        pytest.skip(f"{device} exists here")
    with pytest.raises(ValueError, match=rf"device='{device}': no such device here"):
        LLM(str(llama_dir), device=device)
    EngineConfig(device="cpu").validate()
    EngineConfig(device="auto").validate()


def test_a_bad_prompt_refuses_the_whole_generate_call_and_leaves_nothing_queued(llama_dir):
    # the good prompts before a bad one used to stay queued; finishing first in the next call,
    # they were counted among its results, which then lacked one of its own (KeyError)
    llm = LLM(str(llama_dir), block_size=4)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["Once upon a time", [10 ** 6]], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.prompt for o in outs] == PROMPTS[:2] and all(len(o.token_ids) == 16 for o in outs)


@pytest.mark.parametrize("prompts, params, message", [
    (5, None, "a prompt must be a string or a list of token ids, not int"),
    ([None], None, "not NoneType"),
    ([[1, 2.5]], None, "not list"),
    (["hi"], {"max_tokens": 4}, "params must be SamplingParams"),
])
def test_prompts_and_params_of_the_wrong_type_are_named(llm, prompts, params, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("prompt, params, request_id, message", [
    ([1.5, 2], GREEDY, None, "a prompt must be a string or a list of token ids"),   # once token 1
    (["a"], GREEDY, None, "a prompt must be a string or a list of token ids"),
    ("Once", {"max_tokens": 3}, None, "params must be SamplingParams, not dict"),
    ("Once", GREEDY, 5, "request_id must be a string, not int"),
])
def test_the_engine_names_arguments_of_the_wrong_type(llm, prompt, params, request_id, message):
    with pytest.raises(TypeError, match=message):
        llm.engine.add_request(prompt, params, request_id=request_id)
    assert not llm.engine.has_unfinished()
