"""The chat page at / (serve/chat_page.py, static/chat.html) in a real browser: headless Chromium,
driven by Playwright, against the real server serving the built-in `stories` model (method
dspark) and `couplets` (ar). It sends a message and watches the reply stream in, checks the
stats line (tok/s, tokens per forward) against the server's usage, stops a reply mid-stream,
shows the server's errors (before and during a stream), and keeps the conversation over a reload.

Uses the system Chromium through `executable_path`, as tests/couplet/test_couplet_browser.py
does; the browser tests skip when Playwright or a Chromium is missing (the HTTP checks still
run). With LEAPFROG_SCREENSHOTS=1 it also rewrites docs/chat-page.png (1280x800, viewport only)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from test_server_common import ServerThread, chromium, pace_engine, wait_until

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCREENSHOTS = os.environ.get("LEAPFROG_SCREENSHOTS") == "1"
DESKTOP = {"viewport": {"width": 1280, "height": 800}}
IDLE = 'body[data-state="idle"]'
PROMPT = "Tell me a story about a frog who learns to jump."


@pytest.fixture(scope="module")
def server():
    s = ServerThread("stories", models=["stories", "couplets"], method="dspark", served_model_name=None).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(**DESKTOP)
    p = ctx.new_page()
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(str(e)))
    p.goto(server.url + "/")
    p.wait_for_selector(IDLE)
    yield p
    ctx.close()


def is_chat_post(r) -> bool:
    return r.url.endswith("/v1/chat/completions") and r.request.method == "POST"


def send(page, text: str = PROMPT, timeout: float = 60_000):
    """Types `text`, presses Enter, waits for the reply to end; returns the chat response."""
    page.fill("#prompt", text)
    with page.expect_response(is_chat_post, timeout=timeout) as info:
        page.press("#prompt", "Enter")
    page.wait_for_selector(IDLE, timeout=timeout)
    return info.value


def sse_chunks(text: str) -> list[dict]:
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def watch_text(page) -> None:
    """Records the length of the last reply's text at every change (to see it grow piece by piece)."""
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const t = document.querySelectorAll('.msg[data-role="assistant"] .text');
            if (t.length) window.__lengths.push(t[t.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")


def last_stats(page) -> dict:
    return page.eval_on_selector('.msg[data-role="assistant"]:last-of-type .stats',
                                 "e => ({...e.dataset, text: e.textContent})")


def save_small(png: bytes, target: Path) -> None:
    """Writes a screenshot as a 256-colour PNG (several times smaller, for the docs)."""
    import io
    from PIL import Image
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.FLOYDSTEINBERG).save(target, optimize=True)


# --- over HTTP, no browser ------------------------------------------------------------------------
def test_root_serves_the_chat_page_and_the_couplet_page_stays(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "leapfrog" in r.text and "/v1/chat/completions" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in r.text, sink
    assert "http://" not in r.text and "https://" not in r.text            # nothing from elsewhere
    c = httpx.get(server.url + "/couplet")
    assert c.status_code == 200 and c.headers["content-type"].startswith("text/html") and "春联" in c.text
    doc = httpx.get(server.url + "/openapi.json").json()
    assert list(doc["paths"]["/"]["get"]["responses"]["200"]["content"]) == ["text/html"]


# --- in the browser -------------------------------------------------------------------------------
def test_a_reply_streams_in_with_tok_s_and_tokens_per_forward(page):
    options = page.eval_on_selector_all("#model option", "os => os.map(o => [o.value, o.textContent])")
    assert options == [["stories", "stories · dspark"], ["couplets", "couplets · ar"]]
    assert page.eval_on_selector_all("#method option", "os => os.map(o => o.textContent)") == \
        ["dspark (drafting on)", "ar (drafting off)"]
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "100")
    watch_text(page)
    resp = send(page)
    body = resp.request.post_data_json
    assert body["model"] == "stories" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": PROMPT}] and "speculative" not in body
    assert body["temperature"] == 0 and body["max_tokens"] == 100
    assert body["return_token_ids"] is True          # the live count: the tokens each chunk names
    chunks = sse_chunks(resp.text())
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert page.text_content('.msg[data-role="assistant"] .text') == text.lstrip() and text.strip()
    lengths = page.evaluate("window.__lengths")
    assert len(set(lengths)) >= 5 and lengths == sorted(lengths), lengths          # it grew piece by piece
    stats = last_stats(page)
    n, accepted = usage["completion_tokens"], usage["speculative"]["num_accepted_tokens"]
    assert stats["final"] == "1" and int(stats["tokens"]) == n
    assert float(stats["tpf"]) == pytest.approx(n / (n - accepted), abs=0.01) and float(stats["tpf"]) >= 1
    assert float(stats["tps"]) > 0
    assert "tok/s" in stats["text"] and "tokens/forward" in stats["text"] and "via dspark" in stats["text"]
    line = page.text_content("#stats")
    assert "tok/s" in line and "tokens/forward" in line
    assert page.get_attribute("#stats", "data-final") == "1"
    # drafting off: plain autoregressive, one token a forward
    page.select_option("#method", "ar")
    resp = send(page, "And then?")
    body = resp.request.post_data_json
    assert body["speculative"] == {"num_speculative_tokens": 0}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == text
    assert sse_chunks(resp.text())[-1]["usage"]["speculative"]["drafting_off"] == "request"
    stats = last_stats(page)
    assert stats["tpf"] == "1.00" and stats["final"] == "1" and "via ar" in stats["text"]
    assert page.locator('.msg[data-role="error"]').count() == 0 and not page.errors, page.errors


def test_stop_ends_a_reply_mid_stream(page, server, monkeypatch):
    pace_engine(monkeypatch, 0.05)
    page.fill("#max-tokens", "400")
    page.fill("#prompt", PROMPT)
    generated = server.metric("generation_tokens_total")
    page.click("#send")
    page.wait_for_selector('body[data-state="streaming"]')
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.wait_for_function("""() => document.querySelector('.msg[data-role="assistant"] .text')
                                     .textContent.length > 150""", timeout=30_000)
    page.click("#stop")
    page.wait_for_selector(IDLE, timeout=10_000)
    shown = page.text_content('.msg[data-role="assistant"] .text')
    assert page.get_attribute('.msg[data-role="assistant"]', "data-stopped") == "1"
    assert page.is_visible("#send") and not page.is_visible("#stop")
    stats = last_stats(page)
    assert stats["final"] == "0" and 0 < int(stats["tokens"]) < 400 and "≈" in stats["text"]
    assert page.text_content("#stats").startswith("Stopped:")
    wait_until(lambda: server.metric("num_requests_running") == 0, timeout=10)   # the server stopped too
    # the live count is the tokens the chunks carried (several a chunk), not the chunks: at most
    # what the server made, short of it by what it made after the last chunk read
    made = server.metric("generation_tokens_total") - generated
    assert made - 16 <= int(stats["tokens"]) <= made, (stats, made)
    page.wait_for_timeout(300)
    assert page.text_content('.msg[data-role="assistant"] .text') == shown
    assert page.locator('.msg[data-role="error"]').count() == 0 and not page.errors, page.errors


def test_the_servers_errors_are_shown(page):
    page.fill("#temperature", "-1")
    resp = send(page, "Hello")
    assert resp.status == 400
    err = resp.json()["error"]
    box = page.locator('.msg[data-role="error"]')
    assert box.count() == 1 and box.get_attribute("role") == "alert"
    assert page.locator('.msg[data-role="assistant"]').count() == 0            # no empty reply left behind
    assert box.locator(".who").text_content() == "Error 400 · invalid_request_error"
    assert box.locator(".text").text_content() == err["message"] and "temperature" in err["message"]
    assert box.locator(".param").text_content() == f"param: temperature · code: {err['code']}"
    # an error in the middle of a stream: the text so far stays, the error follows it
    page.fill("#temperature", "")
    evil = "<img src=x onerror=window.__x=1>"
    stream = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Once " + evil}}]},
              {"error": {"message": "the engine stopped: " + evil, "type": "server_error", "param": None,
                         "code": "engine_error"}}]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream",
        body="".join(f"data: {json.dumps(c)}\n\n" for c in stream) + "data: [DONE]\n\n"))
    send(page, "Hello again")
    assert page.text_content('.msg[data-role="assistant"] .text') == "Once " + evil
    assert box.count() == 2
    assert box.nth(1).locator(".text").text_content() == "the engine stopped: " + evil
    assert box.nth(1).locator(".who").text_content() == "Error during the reply · server_error"
    page.wait_for_timeout(200)
    assert page.evaluate("typeof window.__x") == "undefined" and page.locator("#messages img").count() == 0
    assert not page.errors, page.errors


def test_the_conversation_survives_a_reload_and_new_chat_clears_it(page):
    page.fill("#max-tokens", "40")
    send(page, "Hi")
    send(page, "Tell me more.")
    before = page.eval_on_selector_all("#messages .msg", "ms => ms.map(m => [m.dataset.role, m.querySelector('.text').textContent])")
    stats = last_stats(page)
    assert [r for r, _ in before] == ["user", "assistant", "user", "assistant"]
    page.reload()
    page.wait_for_selector(IDLE)
    after = page.eval_on_selector_all("#messages .msg", "ms => ms.map(m => [m.dataset.role, m.querySelector('.text').textContent])")
    assert after == before and last_stats(page) == stats
    assert page.input_value("#max-tokens") == "40"          # the settings too
    page.click("#new-chat")
    assert page.locator("#messages .msg").count() == 0 and page.is_visible("#messages .empty")
    page.reload()
    page.wait_for_selector(IDLE)
    assert page.locator("#messages .msg").count() == 0
    assert not page.errors, page.errors


@pytest.mark.skipif(not SCREENSHOTS, reason="LEAPFROG_SCREENSHOTS=1 rewrites docs/chat-page.png")
def test_screenshot(page):
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "90")
    page.fill("#system", "You tell short stories for children.")
    send(page, PROMPT)
    page.select_option("#method", "ar")
    send(page, "What did the frog do next?")
    page.evaluate("document.activeElement.blur()")
    save_small(page.screenshot(animations="disabled"), DOCS / "chat-page.png")
