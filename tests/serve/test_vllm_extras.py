"""What vLLM's users send beyond the basics: logit_bias (validation, the sampler's arithmetic, the
engine against an equivalent per-request logits processor, an independent path, for `ar` and a
drafted method, and the HTTP contract) and the /tokenize and /detokenize endpoints (against the
checkpoint's tokenizer loaded by transformers, and against what generation counts)."""
from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from leapfrog.sample.sampler import apply_penalties
from leapfrog.sampling_params import SamplingParams
from leapfrog.sequence import Sequence
from test_server_common import ServerThread, assert_error, still_works


@pytest.mark.parametrize("bias, words", [
    ({-1: 1.0}, "non-negative integer"), ({"7": 1.0}, "non-negative integer"),
    ({3: 100.5}, "[-100, 100]"), ({3: float("nan")}, "[-100, 100]"), ({3: True}, "[-100, 100]"),
    ({i: 1.0 for i in range(1025)}, "at most 1024"), ([(3, 1.0)], "must map"),
])
def test_bad_logit_bias_is_a_value_error_naming_it(bias, words):
    with pytest.raises(ValueError, match="logit_bias") as err:
        SamplingParams(logit_bias=bias)
    assert words in str(err.value)


def test_the_bias_is_added_to_the_named_logits_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    seqs = [Sequence("a", [1, 2], SamplingParams(logit_bias={3: 2.5, 7: -100})),
            Sequence("b", [1, 2], SamplingParams())]
    out = apply_penalties(logits.clone(), seqs)
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 7] -= 100
    assert torch.equal(out, want)


def _as_processor(bias: dict[int, float]):
    def process(output_ids, row):
        for token, value in bias.items():
            row[token] += value
        return row
    return process


@pytest.mark.parametrize("method", ["ar", "dspark"])
def test_engine_output_equals_an_equivalent_logits_processor(method):
    """Greedy `stories`: banning the tokens the unbiased text starts with, and pushing one up,
    gives exactly what a logits processor doing the same gives; the drafted method's output
    equals `ar`'s under the bias too (drafts are not verified for such a request)."""
    from leapfrog import LLM

    llm = LLM("stories", method=method, num_threads=1)
    prompt = ["Once upon a time"]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    bias = {plain[0]: -100.0, plain[1]: -100.0, 262: 3.0}
    biased = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logit_bias=bias))[0]
    oracle = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                 logits_processors=[_as_processor(bias)]))[0]
    assert biased.token_ids == oracle.token_ids
    assert plain[0] not in biased.token_ids and plain[1] not in biased.token_ids
    sampled = [llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=3, **kw))[0].token_ids
               for kw in ({"logit_bias": bias}, {"logits_processors": [_as_processor(bias)]})]
    assert sampled[0] == sampled[1] and not {plain[0], plain[1]} & set(sampled[0])
    if method == "ar":
        forced = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                     logit_bias={262: 100.0}))[0]
        assert forced.token_ids == [262] * 6
    else:
        ar = LLM("stories", method="ar", num_threads=1)
        assert ar.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logit_bias=bias))[0].token_ids \
            == biased.token_ids
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 4096\)"):
        llm.generate(prompt, SamplingParams(max_tokens=4, logit_bias={4096: 1.0}))


def test_block_diffusion_honours_the_bias_at_every_position_it_decides():
    from leapfrog import LLM

    llm = LLM("stories-diffusion", num_threads=1)
    prompt = ["Once upon a time"]
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].token_ids
    banned = {plain[0]: -100.0, plain[2]: -100.0}
    biased = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, logit_bias=banned))[0].token_ids
    assert len(biased) == 16 and not set(banned) & set(biased)


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_http_logit_bias_forces_and_bans_tokens(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    forced = post(server, "/v1/completions", {**body, "logit_bias": {"11": 100}})
    assert forced.status_code == 200, forced.text
    tokens = forced.json()["choices"][0]["logprobs"]["tokens"]
    assert len(set(tokens)) == 1 and len(tokens) == 5 and tokens != plain
    # every endpoint takes it: +100 forces the same three tokens whatever the prompt
    force = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"11": 100}}
    texts = [post(server, "/v1/completions", {"prompt": "hi", **force}).json()["choices"][0]["text"],
             post(server, "/generate", {"prompt": "Once", **force}).json()["text"],
             post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **force}
                  ).json()["choices"][0]["message"]["content"]]
    unbiased = post(server, "/generate", {"prompt": "Once", **force, "logit_bias": None}).json()["text"]
    assert texts[0] == texts[1] == texts[2] != unbiased


@pytest.mark.parametrize("bias, code, param", [
    ({"abc": 1}, "invalid_token_id", "logit_bias"), ({"-3": 1}, "invalid_token_id", "logit_bias"),
    ({"1e3": 1}, "invalid_token_id", "logit_bias"),
    ({"99999999999999999999999": 1}, "invalid_token_id", "logit_bias"),
    ({"5": 101}, "invalid_value", "logit_bias"), ({"5": "1"}, "invalid_type", "logit_bias.5"),
])
def test_http_bad_logit_bias_is_a_400_naming_it(server, bias, code, param):
    resp = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
    assert_error(resp, 400, code, param)
    still_works(server.url)


# --- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_gives_the_ids_generation_is_fed(server, llama_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_dir)
    text = "Once upon a time, a cat sat."
    got = post(server, "/tokenize", {"prompt": text}).json()
    assert got["tokens"] == hf.encode(text) and got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == hf.encode(text, add_special_tokens=False) and len(bare) == got["count"] - 1
    done = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    messages = [{"role": "user", "content": "hi there"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    answer = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"] > 0
    back = post(server, "/detokenize", {"tokens": bare}).json()
    assert back == {"prompt": hf.decode(bare)}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenize_renders_what_a_chat_request_with_the_same_fields_renders(server):
    """tools, continue_final_message and chat_template_kwargs change a chat's prompt: /tokenize
    takes them (vLLM's fields), so a tool chat's prompt can be counted before it is sent."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    got = post(server, "/tokenize", {"messages": messages, "tools": tools, "return_token_strs": True}).json()
    assert got["count"] > post(server, "/tokenize", {"messages": messages}).json()["count"]
    # this model's context is too short for the tools' prompt: the chat's refusal counts it
    chat = post(server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1})
    assert f"prompt has {got['count']} tokens" in chat.json()["error"]["message"]
    assert len(got["token_strs"]) == got["count"] and all(isinstance(t, str) for t in got["token_strs"])
    cont = messages + [{"role": "assistant", "content": "The weather"}]
    body = {"messages": cont, "add_generation_prompt": False, "continue_final_message": True}
    reply = post(server, "/v1/chat/completions", {**body, "max_tokens": 1}).json()
    assert post(server, "/tokenize", body).json()["count"] == reply["usage"]["prompt_tokens"]
    assert post(server, "/tokenize", {**body, "add_generation_prompt": True}).status_code == 400


def test_an_empty_prompt_tokenizes_as_its_schema_says(server):
    """/tokenize takes "" (its ids: at most the BOS a prompt gets); the generation endpoints'
    schemas keep a prompt's minimum length, and answer "" with a 400."""
    got = post(server, "/tokenize", {"prompt": ""})
    assert got.status_code == 200 and got.json()["tokens"] == post(server, "/tokenize", {"prompt": "x"}).json()["tokens"][:1]
    assert post(server, "/tokenize", {"prompt": "", "add_special_tokens": False}).json()["tokens"] == []
    doc = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    strings = lambda name: [b for b in doc[name]["properties"]["prompt"]["anyOf"] if b.get("type") == "string"]  # noqa: E731
    assert all("minLength" not in b for b in strings("TokenizeRequest"))
    assert all(b.get("minLength") == 1 for b in strings("CompletionRequest"))
    assert post(server, "/v1/completions", {"prompt": "", "max_tokens": 1}).status_code == 400


@pytest.mark.parametrize("path, body, status, code, param", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "missing_field", "prompt"),
    ("/tokenize", {}, 400, "missing_field", "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, 404, "model_not_found", "model"),
    ("/tokenize", {"prompt": "hi", "extra": 1}, 400, None, "extra"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "invalid_token_id", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_token_id", "tokens"),
    ("/detokenize", {}, 400, None, "tokens"),
])
def test_tokenizer_endpoints_answer_bad_input_with_a_4xx(server, path, body, status, code, param):
    assert_error(post(server, path, body), status, code, param)
    still_works(server.url)


# --- vLLM's chat and prompt extras: continue_final_message, chat_template_kwargs, truncation -----
GREEDY4 = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_continue_final_message_feeds_the_last_message_open(server):
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Once upon a"}]
    resp = post(server, "/v1/chat/completions", {"messages": msgs, "add_generation_prompt": False,
                                                 "continue_final_message": True, **GREEDY4})
    assert resp.status_code == 200, resp.text
    # the test template writes "<s>{role}: {content}\n" a message: the prompt stops after "a"
    same = post(server, "/v1/completions", {"prompt": "user: hi there\n<s>assistant: Once upon a", **GREEDY4}).json()
    assert resp.json()["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert resp.json()["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    closed = post(server, "/v1/chat/completions", {"messages": msgs, "add_generation_prompt": False, **GREEDY4})
    assert closed.json()["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"] + 1    # the "\n"


class RecordingTemplate:
    """A tokenizer stub whose chat template records the keyword arguments it is given."""
    has_chat_template, template_reads_tools, bos_token_id = True, False, None

    def __init__(self) -> None:
        self.seen: dict = {}

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.seen.update(kwargs)
        return "x"

    def encode(self, text):
        return [5]


def recording_template():
    t = RecordingTemplate()
    return t.seen, t


def test_chat_template_kwargs_reach_the_template():
    from leapfrog.serve.openai_api import Limits, render_chat
    from leapfrog.serve.protocol import ChatRequest

    seen, template = recording_template()
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                      "chat_template_kwargs": {"enable_thinking": False, "n": 2}})
    render_chat(req, template, Limits({"m"}, 256, 100, 16, {}, 1))
    assert seen == {"enable_thinking": False, "n": 2}


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    ids = post(server, "/tokenize", {"prompt": "Once upon a time, a cat sat on a mat."}).json()["tokens"]
    cut = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 3, **GREEDY4}).json()
    tail = post(server, "/v1/completions", {"prompt": ids[-3:], **GREEDY4}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    echoed = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 3, "echo": True,
                                              **GREEDY4}).json()["choices"][0]["text"]
    assert echoed == post(server, "/detokenize", {"tokens": ids[-3:]}).json()["prompt"] + cut["choices"][0]["text"]
    text = post(server, "/v1/completions", {"prompt": "a cat sat. " * 200, "truncate_prompt_tokens": 50, **GREEDY4})
    assert text.status_code == 200 and text.json()["usage"]["prompt_tokens"] == 50     # longer than the context
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                                                 "truncate_prompt_tokens": 2, **GREEDY4})
    assert chat.json()["usage"]["prompt_tokens"] == 2


USER_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER_HI + [{"role": "assistant", "content": "a"}],
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": USER_HI, "continue_final_message": True,
                              "add_generation_prompt": False}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": USER_HI + [{"role": "assistant", "content": " "}],
                              "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": USER_HI, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),
    ("/v1/chat/completions", {"messages": USER_HI, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER_HI, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
])
def test_bad_chat_extras_are_a_400_naming_them(server, path, body, param):
    assert_error(post(server, path, {**body, "max_tokens": 2}), 400, None, param)
    still_works(server.url)


def test_a_prediction_is_taken_and_leaves_the_output_as_it_was(server):
    msgs = [{"role": "user", "content": "hi there"}]
    plain = post(server, "/v1/chat/completions", {"messages": msgs, **GREEDY4}).json()
    text = plain["choices"][0]["message"]["content"]
    for content in (text, [{"type": "text", "text": text}], "something else"):
        got = post(server, "/v1/chat/completions", {"messages": msgs, "prediction": {"type": "content", "content": content},
                                                    **GREEDY4})
        assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == text
    done = post(server, "/v1/completions", {"prompt": "hi", "prediction": {"type": "content", "content": "x"}, **GREEDY4})
    assert done.status_code == 200


@pytest.mark.parametrize("prediction, param", [
    ({"type": "text", "content": "x"}, "prediction.type"), ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content"}, "prediction.content"), ({"type": "content", "content": [{"type": "image", "text": "x"}]},
                                                  "prediction.content"),
])
def test_a_bad_prediction_is_a_400_naming_it(server, prediction, param):
    resp = post(server, "/v1/chat/completions", {"messages": USER_HI, "prediction": prediction, "max_tokens": 2})
    assert_error(resp, 400, None, param)
    still_works(server.url)


def test_openais_service_fields_are_taken(server):
    body = {"messages": USER_HI, **GREEDY4}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    extra = {"reasoning_effort": "low", "verbosity": "low", "metadata": {"run": "7"}, "store": False,
             "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1", "modalities": ["text"]}
    got = post(server, "/v1/chat/completions", {**body, **extra})
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == plain
    assert_error(post(server, "/v1/chat/completions", {**body, "reasoning_effort": "max"}), 400, None,
                 "reasoning_effort")
    assert_error(post(server, "/v1/chat/completions", {**body, "metadata": {"k": 1}}), 400, None, "metadata.k")
    assert_error(post(server, "/v1/chat/completions", {**body, "modalities": ["text", "audio"]}), 400, None,
                 "modalities")


def test_reasoning_effort_reaches_the_template():
    from leapfrog.serve.openai_api import Limits, render_chat
    from leapfrog.serve.protocol import ChatRequest

    seen, template = recording_template()
    limits = Limits({"m"}, 256, 100, 16, {}, 1)
    render_chat(ChatRequest.model_validate({"messages": USER_HI, "reasoning_effort": "high"}), template, limits)
    assert seen == {"reasoning_effort": "high"}
    seen.clear()       # chat_template_kwargs say it first
    render_chat(ChatRequest.model_validate({"messages": USER_HI, "reasoning_effort": "high",
                                            "chat_template_kwargs": {"reasoning_effort": "low"}}), template, limits)
    assert seen == {"reasoning_effort": "low"}


def test_allowed_token_ids_keep_sampling_to_those_ids(server):
    """vLLM's allowed_token_ids: every sampled token is one of them, greedy or not; ids outside
    the vocabulary and an empty list are 400s naming the field."""
    vocab = server.state.engine.info.vocab_size
    allowed = [5, 9, 11, 12, 40]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True,
                                            "allowed_token_ids": allowed, **extra})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        pieces = {post(server, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
        assert text and re.fullmatch("(" + "|".join(map(re.escape, sorted(pieces, key=len, reverse=True))) + ")+",
                                     text), text
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "allowed_token_ids": [vocab]}), 400,
                 "invalid_token_id", "allowed_token_ids")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}), 400, None,
                 "allowed_token_ids")
    assert_error(post(server, "/v1/chat/completions", {"messages": USER_HI, "allowed_token_ids": [5],
                                                       "response_format": {"type": "json_object"}}), 400, None,
                 "allowed_token_ids")
    still_works(server.url)


def _streamed(server, path: str, body: dict) -> tuple[list, list[int], str]:
    """(prompt_token_ids seen, the token_ids deltas joined, the text joined) of a stream."""
    prompts, ids, text = [], [], ""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                prompts += [c["prompt_token_ids"]] if "prompt_token_ids" in c else []
                ids += c["token_ids"]
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            prompts += [chunk["prompt_token_ids"]] if "prompt_token_ids" in chunk else []
    return prompts, ids, text


def test_return_token_ids_gives_the_prompt_and_reply_ids_whole_and_streamed(server):
    """vLLM's return_token_ids: completions carry prompt_token_ids and token_ids per choice, chat
    the prompt's ids once and each choice's token_ids; streamed, the prompt's ids come once and
    the token_ids deltas join into the whole reply's."""
    base = {"prompt": "Once upon a time", **GREEDY4, "max_tokens": 6, "return_token_ids": True}
    whole = post(server, "/v1/completions", base).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == post(server, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    assert len(choice["token_ids"]) == 6 == whole["usage"]["completion_tokens"]
    assert post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    prompts, ids, text = _streamed(server, "/v1/completions", base)
    assert prompts == [choice["prompt_token_ids"]] and ids == choice["token_ids"] and text == choice["text"]
    plain = post(server, "/v1/completions", {**base, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    chat = {"messages": USER_HI, **GREEDY4, "max_tokens": 6, "return_token_ids": True}
    body = post(server, "/v1/chat/completions", chat).json()
    assert body["prompt_token_ids"] == post(server, "/tokenize", {"messages": USER_HI}).json()["tokens"]
    assert len(body["choices"][0]["token_ids"]) == 6
    prompts, ids, text = _streamed(server, "/v1/chat/completions", chat)
    assert prompts == [body["prompt_token_ids"]] and ids == body["choices"][0]["token_ids"]
    assert text == body["choices"][0]["message"]["content"]


def test_cache_salt_is_taken_and_checked(server):
    """vLLM's cache_salt (the prefix cache's isolation is tested on the block manager): a salted
    request is served as an unsalted one would be; an empty salt is a 400 naming it."""
    body = {"prompt": "Once upon a time, a cat", **GREEDY4}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        r = post(server, "/v1/completions", {**body, "cache_salt": salt})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
    assert_error(post(server, "/v1/completions", {**body, "cache_salt": ""}), 400, None, "cache_salt")


def test_bad_words_over_http(server):
    """vLLM's bad_words reach the engine (its token sequences are tested there): a token the
    greedy reply writes, banned as a word, is gone; a blank word is a 400 naming the field."""
    body = {"prompt": "Once upon a time", **GREEDY4, "max_tokens": 16, "return_token_ids": True}
    ids = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    word = None
    for t in ids:          # a token that is a word of its own: its text tokenizes back to it
        text = post(server, "/detokenize", {"tokens": [t]}).json()["prompt"]
        if text.strip() and text.isascii() and \
                post(server, "/tokenize", {"prompt": text.strip(), "add_special_tokens": False}).json()["tokens"] == [t]:
            word = (t, text.strip())
            break
    assert word is not None, ids
    banned = post(server, "/v1/completions", {**body, "bad_words": [word[1]]}).json()["choices"][0]["token_ids"]
    assert word[0] not in banned and len(banned) == 16
    assert_error(post(server, "/v1/completions", {**body, "bad_words": [" "]}), 400, None, "bad_words")


@pytest.mark.parametrize("stream", [False, True])
def test_what_a_diffusion_method_cannot_do_is_a_400_naming_the_field_streamed_too(stream):
    """Refused before anything is queued, so a streamed request gets a 400 too, not a 200 with
    the error in the event stream; the field the client sent is the one named."""
    from leapfrog.config import resolve_model
    s = ServerThread(resolve_model("stories-diffusion"), max_batch_size=2).start()
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
        cases = [
            ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": stream,
                                 "response_format": {"type": "json_object"}}, "response_format"),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": stream, "guided_regex": "[a-z]+"},
             "guided_regex"),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": stream, "echo": True, "logprobs": 1},
             "echo"),
            ("/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream": stream, "prompt_logprobs": 1},
             "prompt_logprobs"),
            ("/v1/chat/completions", {**chat, "prompt_logprobs": 0}, "prompt_logprobs"),
            ("/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "required"}, "tools"),
        ]
        for path, body, param in cases:
            r = post(s, path, body)
            assert r.status_code == 400, (param, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"] and "diffusion" in err["message"]
        # what it can do still runs: tools offered with tool_choice auto, a plain stream
        r = post(s, "/v1/chat/completions", {**chat, "stream": False, "tools": tools})
        assert r.status_code == 200, r.text
    finally:
        s.stop()
