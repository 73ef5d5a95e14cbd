"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) and /v1/completions `echo`.

Oracle: transformers' forward over the same prompt, teacher-forced: entry p is the
log-probability of prompt token p under the distribution after tokens 0..p-1."""
from __future__ import annotations

import json

import pytest
import torch

from leapfrog import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Once upon a time there was a little cat who liked to sleep in the sun all day long",
           "The dog ran", "春回大地万象新"]


def reference(folder, ids: list[int]) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)


def check(out, folder, k: int) -> None:
    ids = out.prompt_token_ids
    lp = reference(folder, ids)
    entries = out.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        e = entries[p]
        assert e["token_id"] == ids[p]
        assert e["logprob"] == pytest.approx(lp[p - 1, ids[p]].item(), abs=2e-4)
        assert len(e["top"]) == k
        if k:
            values, indices = lp[p - 1].topk(k)
            assert [i for i, _ in e["top"]] == indices.tolist()
            assert [v for _, v in e["top"]] == pytest.approx(values.tolist(), abs=2e-4)


@pytest.mark.parametrize("chunk", [2048, 8])
def test_prompt_logprobs_equal_a_teacher_forced_forward(llama_dir, chunk):
    # chunk 8: the long prompt is prefilled in chunks, and shares its steps with the others
    llm = LLM(str(llama_dir), block_size=4, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        check(out, llama_dir, 3)
    # the outputs are the ones a request without prompt logprobs gets
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llama_dir):
    llm = LLM(str(llama_dir), block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:1], params)                     # its blocks are now cached
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                   prompt_logprobs=0))[0]
    assert out.metrics.num_cached_prompt_tokens == 0
    check(out, llama_dir, 0)
    again = llm.generate(PROMPTS[:1], params)[0]            # the cache still serves the others
    assert again.metrics.num_cached_prompt_tokens > 0


def test_prompt_logprobs_with_a_speculative_method(llama_dir, draft_dir):
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), block_size=4)
    ar = LLM(str(llama_dir), block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        check(out, llama_dir, 1)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar.generate(PROMPTS, params)]


def test_out_of_range_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs=21: must be in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs=-1"):
        SamplingParams(prompt_logprobs=-1)


# --- over HTTP: echo and vLLM's prompt_logprobs ----------------------------------------------
@pytest.fixture(scope="module")
def server(llama_dir):
    from test_server_common import ServerThread
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


def post(server, path: str, body: dict) -> dict:
    import httpx
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_a_continuation_as_lm_eval_asks(server, llama_dir):
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one new token;
    # it sums token_logprobs[len(context):-1]
    from leapfrog.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(llama_dir)
    context, continuation = tok.encode("The cat sat"), tok.encode(" on the mat", add_special_tokens=False)
    ids = context + continuation
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
                                            "logprobs": 1})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) <= 1 for t in lp["top_logprobs"][1:])
    ref = reference(llama_dir, ids)
    expected = sum(ref[p - 1, ids[p]].item() for p in range(len(context), len(ids)))
    assert sum(lp["token_logprobs"][len(context):-1]) == pytest.approx(expected, abs=1e-3)
    # is_greedy, as lm-eval reads it: each top alternative against the token itself
    greedy = all(max(top, key=top.get) == tok_text for top, tok_text in
                 zip(lp["top_logprobs"][len(context):-1], lp["tokens"][len(context):-1]))
    assert greedy == all(ref[p - 1].argmax().item() == ids[p] for p in range(len(context), len(ids)))


def test_echo_puts_the_prompt_before_the_completion(server):
    prompt = "Once upon a time"
    plain = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                             "ignore_eos": True})["choices"][0]
    echo = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                            "ignore_eos": True, "echo": True})["choices"][0]
    assert echo["text"] == prompt + plain["text"]
    lp, tail = echo["logprobs"], plain["logprobs"]
    k = len(lp["tokens"]) - len(tail["tokens"])
    assert lp["tokens"][k:] == tail["tokens"] and lp["token_logprobs"][k:] == pytest.approx(tail["token_logprobs"])
    # offsets index the echoed text (the special <s> takes no room in it; a stray byte of the
    # random model shows its bytes, which are not text)
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        if token != "<s>" and not token.startswith("bytes:"):
            assert echo["text"][offset:offset + len(token)] == token
    # streamed, the first chunk carries the prompt: the same text and logprobs
    import httpx
    text, tokens, values = "", [], []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True,
                            "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
    assert text == echo["text"] and tokens == lp["tokens"] and values == lp["token_logprobs"]


def test_vllm_prompt_logprobs_in_completions_and_chat(server, llama_dir):
    body = post(server, "/v1/completions", {"prompt": "The dog ran to the park", "max_tokens": 2,
                                            "prompt_logprobs": 2})
    entries = body["choices"][0]["prompt_logprobs"]
    from leapfrog.tokenizer import Tokenizer
    ids = Tokenizer.from_folder(llama_dir).encode("The dog ran to the park")
    ref = reference(llama_dir, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row = entries[p]
        assert str(ids[p]) in row and 2 <= len(row) <= 3
        own = row[str(ids[p])]
        assert own["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=2e-4)
        assert own["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert sorted(v["rank"] for v in row.values())[:2] == [1, 2]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    import httpx
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "The dog", "prompt_logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_max_tokens_zero_with_echo_scores_the_prompt_only(server, llama_dir):
    # OpenAI's scoring request (no completion): the prompt's text and logprobs, 0 completion tokens
    import httpx
    prompt = "The dog ran to the park"
    full = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1})
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice, lp = body["choices"][0], body["choices"][0]["logprobs"]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"] == full["choices"][0]["logprobs"]["token_logprobs"][:-1]
    streamed = ""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 0, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["text"]
    assert streamed == prompt
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and "needs echo" in r.json()["error"]["message"]


def test_a_preempted_prompt_is_scored_again_the_same(llama_dir):
    # a cache of 64 tokens for four requests of up to ~45: some are preempted and recomputed
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=1)
    prompts = [[1, 5, 9, 30, 44, 61, 70, 80, 90, 100, 110], [1, 100, 200, 7, 7, 7, 8, 9, 10, 11, 12],
               [1, 5, 9, 30, 44], [1, 300, 301, 302, 303, 304, 305]]
    small = LLM(str(llama_dir), block_size=4, kv_cache_tokens=64, enable_prefix_caching=False)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    want = LLM(str(llama_dir), block_size=4).generate(prompts, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.prompt_logprobs[0] is None
        assert [e["logprob"] for e in a.prompt_logprobs[1:]] == pytest.approx(
            [e["logprob"] for e in b.prompt_logprobs[1:]], abs=1e-5)


def test_streamed_prompt_logprobs_arrive_even_while_the_text_is_held_back(server):
    # a long stop string holds every delta back until the end: the first output says nothing
    # else, and its prompt_logprobs were dropped with it
    import httpx
    body = {"prompt": "The dog ran to the park", "max_tokens": 4, "prompt_logprobs": 1, "stop": ["x" * 60],
            "ignore_eos": True}
    whole = post(server, "/v1/completions", body)["choices"][0]
    got = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if "prompt_logprobs" in choice:
                    got.append(choice["prompt_logprobs"])
    assert got == [whole["prompt_logprobs"]]
