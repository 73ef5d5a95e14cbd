"""Static checks on the couplet page (leapfrog/serve/static/couplet.html): a self-contained HTML
file that asks POST /couplet for a couplet and shows it with text nodes only. The browser test
that clicks through it lives with the server tests; this one needs no server and no browser.
`node --check` parses the script when node is installed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "leapfrog" / "serve" / "static" / "couplet.html"


@pytest.fixture(scope="module")
def html() -> str:
    return PAGE.read_text(encoding="utf-8")


def scripts(html: str) -> list[str]:
    return re.findall(r"<script\b[^>]*>(.*?)</script>", html, flags=re.S | re.I)


def test_is_a_page_for_phones_and_desktops(html):
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert re.search(r'<meta\s+name="viewport"\s+content="[^"]*width=device-width', html)
    assert '<meta charset="utf-8">' in html.lower()
    assert "clamp(" in html and "vw" in html


def test_posts_keywords_to_the_couplet_api(html):
    js = "\n".join(scripts(html))
    assert "/couplet" in js and "fetch(" in js
    assert re.search(r'method:\s*"POST"', js)
    assert "keywords" in js and "Authorization" in js and "Bearer " in js
    assert "sessionStorage" in js


@pytest.mark.parametrize("sink", ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                                  "new Function", "srcdoc"])
def test_never_writes_markup_from_data(html, sink):
    assert sink not in html


def test_no_external_resources(html):
    assert not re.search(r"https?://", html, flags=re.I)
    assert not re.search(r"<(link|script|img|iframe)\b[^>]*\b(src|href)=\"(?!data:)[^\"]+\"", html, flags=re.I)
    assert "@import" not in html and "url(" not in html


def test_the_gate(html):
    assert re.search(r"writing-mode:\s*vertical-rl", html)
    assert "开门见喜" in html and "再写一副" in html and "复制" in html
    for hook in ('id="keywords"', 'id="write"', 'id="upper"', 'id="lower"', 'id="horizontal"',
                 'id="rules"', 'aria-live="polite"', 'role="alert"', '<label'):
        assert hook in html, hook
    for label in ("字数相等", "不重字", "关键词", "仄起平收", "横批四字"):
        assert label in html, label


def test_plain_words_for_errors(html):
    js = "\n".join(scripts(html))
    for status in ("429", "401", "503", "Retry-After"):
        assert status in js, status
    assert "too many people" in js.lower()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_script_parses(html, tmp_path):
    (body,) = scripts(html)
    path = tmp_path / "couplet.js"
    path.write_text(body, encoding="utf-8")
    result = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
