"""The couplet page in a real browser (issue 21): headless Chromium, driven by Playwright, against
the real server serving the built-in `couplets` model. It types keywords, clicks 开门见喜, waits
for the doors to open and checks that the page shows exactly what the server wrote; then, with the
POST answered by Playwright instead, that markup in a reply is shown as text and that a 429 reads
as a plain sentence.

Uses the system Chromium (Debian's `chromium`; scripts/install.sh installs it with the CJK fonts)
through `executable_path`, since Playwright's own browser download is not needed. Skips when
Playwright or a Chromium is missing. With LEAPFROG_SCREENSHOTS=1 it also rewrites
docs/couplet-page.png (1280x900) and docs/couplet-page-phone.png (390x844), viewport only."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from leapfrog.couplet import rules
from test_server_common import BROWSER, ServerThread, chromium, couplet_places_taken, on_loop, wait_until

pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
if BROWSER is None:
    pytest.skip("no Chromium found (chromium, chromium-browser or google-chrome on PATH)", allow_module_level=True)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCREENSHOTS = os.environ.get("LEAPFROG_SCREENSHOTS") == "1"
KEYWORDS = "马年 吉祥"
DESKTOP = {"viewport": {"width": 1280, "height": 900}}
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 1, "is_mobile": True, "has_touch": True}
OPENED = '#gate[data-opened="1"]'


@pytest.fixture(scope="module")
def server():
    # `model` is the positional argument; with it set to "couplets" the server serves that alone.
    s = ServerThread("couplets", served_model_name=None).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


def open_page(browser, server, **context):
    ctx = browser.new_context(locale="zh-CN", **context)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/couplet")
    page.wait_for_selector('body[data-state="idle"]')
    return ctx, page, errors


def fake_reply(page, status: int, body: dict, headers: dict | None = None) -> None:
    """Answers the page's POST /couplet from here; the page itself (a GET) still comes from the server."""
    def handle(route):
        if route.request.method != "POST":
            return route.continue_()
        route.fulfill(status=status, content_type="application/json", body=json.dumps(body), headers=headers or {})
    page.route("**/couplet", handle)


def write(page, keywords: str = KEYWORDS) -> dict:
    """Types the keywords, clicks 开门见喜 and returns the couplet the server sent for that POST
    (the `couplet` event of its stream, or a plain JSON reply)."""
    page.fill("#keywords", keywords)
    with page.expect_response(lambda r: r.url.endswith("/couplet") and r.request.method == "POST",
                              timeout=90_000) as info:
        page.click("#write")
    resp = info.value
    assert resp.request.post_data_json == {"keywords": keywords, "stream": True}   # the first sends no seed
    if not resp.ok:
        return {"status": resp.status}
    if not resp.headers["content-type"].startswith("text/event-stream"):
        return resp.json()
    events = dict(couplet_events(resp.text()))
    return events["couplet"]


def couplet_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def no_horizontal_scroll(page) -> bool:
    return page.evaluate("document.scrollingElement.scrollWidth <= window.innerWidth")


def save_small(png: bytes, target: Path) -> None:
    """Writes a screenshot as a 256-colour PNG (five to seven times smaller, for the docs)."""
    import io
    from PIL import Image                                            # comes with matplotlib
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.FLOYDSTEINBERG).save(target, optimize=True)


def shown(page) -> tuple[str, str, str]:
    return tuple(page.text_content(sel) for sel in ("#upper", "#lower", "#horizontal"))


@pytest.mark.parametrize("name,context", [("desktop", DESKTOP), ("phone", PHONE)])
def test_doors_open_on_the_servers_couplet(browser, server, name, context):
    ctx, page, errors = open_page(browser, server, **context)
    try:
        data = write(page)
        assert {"upper", "lower", "horizontal", "keywords", "rules"} <= set(data), data
        page.wait_for_selector(OPENED, timeout=30_000)
        assert page.get_attribute("body", "data-state") == "open"
        up, low, hor = data["upper"], data["lower"], data["horizontal"]
        assert shown(page) == (up, low, hor)                    # exactly what the server wrote
        assert len(rules.hanzi(up)) == len(rules.hanzi(low)) >= 5
        assert data["keywords"] == rules.split_keywords(KEYWORDS) == ["马年", "吉祥"]
        assert data["rules"] == rules.check(up, low, hor, data["keywords"])
        # keyword characters in the lines are picked out in gold, and only those
        kw = set("".join(data["keywords"]))
        marked = page.eval_on_selector_all("#upper .kw, #lower .kw", "els => els.map(e => e.textContent)")
        assert marked == [c for c in up + low if c in kw]
        assert page.text_content("#error") == "" and page.is_visible("#after")
        assert len(page.query_selector_all("#rules li")) == len(data["rules"])
        assert no_horizontal_scroll(page), f"the {name} page scrolls sideways"
        assert not errors, errors
        if SCREENSHOTS:
            target = DOCS / ("couplet-page.png" if name == "desktop" else "couplet-page-phone.png")
            save_small(page.screenshot(animations="disabled"), target)    # the viewport, not the full page
    finally:
        ctx.close()


def test_markup_in_a_reply_is_shown_as_text(browser, server):
    ctx, page, errors = open_page(browser, server, **DESKTOP)
    try:
        evil = {"upper": "<img src=x onerror=window.__x=1>", "lower": "<b>下</b><script>window.__x=2</script>",
                "horizontal": "<svg onload=window.__x=3>", "keywords": ["<i>", "马"],
                "rules": {"<img src=x onerror=window.__x=4>": True}, "timing": {"seconds": 0.1}}
        fake_reply(page, 200, evil)
        write(page)
        page.wait_for_selector(OPENED, timeout=30_000)
        assert shown(page) == (evil["upper"], evil["lower"], evil["horizontal"])
        page.wait_for_timeout(300)                               # time for an image error to fire
        assert page.evaluate("typeof window.__x") == "undefined"
        assert page.evaluate("document.querySelectorAll('img, svg, b').length + document.scripts.length") == 1
        assert "<img" in page.text_content("#rules")
        assert not errors, errors
        # the control: the same markup through innerHTML does run here (the page's CSP allows inline
        # handlers), so the checks above would catch a page that used it
        assert page.evaluate("""async () => {
            document.body.appendChild(document.createElement("div")).innerHTML = "<img src=x onerror=window.__y=1>";
            for (let i = 0; i < 50 && window.__y !== 1; i++) await new Promise((r) => setTimeout(r, 100));
            return window.__y === 1;
        }""")
    finally:
        ctx.close()


def test_the_page_waits_in_line_and_retries_a_busy_server_by_itself(browser, server):
    """A server kept busy: every couplet place taken. First the line is closed too (wait bound 0),
    so each press is a 429 with Retry-After: the page says it will try again and does, by itself.
    Then the line opens: the page's next try waits in it and shows its place. Then a place frees
    and the doors open on the couplet. One click in all."""
    ctx, page, errors = open_page(browser, server, **DESKTOP)
    posts: list[int] = []
    page.on("response", lambda r: posts.append(r.status) if r.request.method == "POST" else None)
    try:
        with couplet_places_taken(server, rate=1.0) as (line, holders):
            line.max_wait_s = 0.0                            # no room in line: 429, Retry-After 1 s
            page.fill("#keywords", KEYWORDS)
            page.click("#write")
            page.wait_for_selector('#status[data-retry="2"]', timeout=30_000)
            assert posts[:2] == [429, 429] and "自动再试" in page.text_content("#status")
            assert page.text_content("#error") == "" and page.get_attribute("body", "data-state") == "writing"
            line.max_wait_s = 10.0                           # the line opens: the next try waits in it
            page.wait_for_selector('#status[data-queued="1"]', timeout=30_000)
            assert "排队中：第 1 位" in page.text_content("#status") and "In line: number 1" in page.text_content("#status")
            on_loop(server, line.release, holders.pop())     # a place frees
            page.wait_for_selector(OPENED, timeout=60_000)
        assert posts[-1] == 200 and posts.count(429) >= 2
        up, low, hor = shown(page)
        assert len(rules.hanzi(up)) == len(rules.hanzi(low)) >= 5 and len(hor) == 4
        assert page.text_content("#error") == "" and not errors, errors
    finally:
        ctx.close()


def test_after_a_minute_of_429s_the_page_says_plainly_that_the_server_is_too_busy(browser, server):
    """Answers faked as 429 (Retry-After 7) and the page's clock run forward: it retries every
    7-8 s for a minute, then gives up with a plain sentence, the button usable again."""
    ctx, page, errors = open_page(browser, server, **DESKTOP)
    try:
        page.clock.install()
        tries: list[float] = []

        def handle(route):
            if route.request.method != "POST":
                return route.continue_()
            tries.append(page.evaluate("performance.now()"))
            route.fulfill(status=429, content_type="application/json", headers={"Retry-After": "7"},
                          body=json.dumps({"error": {"message": "queue full", "type": "rate_limit", "param": None,
                                                     "code": "queue_full"}}))
        page.route("**/couplet", handle)
        page.fill("#keywords", KEYWORDS)
        page.click("#write")
        for _ in range(80):
            # the page's clock stands still while an answer is on its way: on a loaded machine the
            # faked 429 can take several of the loop's real round trips to arrive
            for _ in range(400):
                if "Writing" not in (page.text_content("#status") or "") or page.text_content("#error"):
                    break
                page.wait_for_timeout(25)
            page.clock.run_for(1000)
            if page.text_content("#error"):
                break
        text = page.text_content("#error")
        assert "太忙" in text and "too busy" in text, text
        assert not any(s in text for s in ("{", "<", "queue_full", "429")), text
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        # never before Retry-After; at most 1 s of jitter later, plus the page's 1 s countdown ticks
        # landing on the clock's 1 s steps (up to 2 s more)
        assert 5 <= len(tries) <= 9 and all(7000 <= g <= 10_500 for g in gaps), (tries, gaps)
        assert tries[-1] - tries[0] <= 62_000          # a minute, plus the clock's steps
        assert page.get_attribute("#gate", "data-state") == "idle" and page.is_enabled("#write")
        assert not errors, errors
    finally:
        ctx.close()
