"""leapfrog.couplet.rules and .quality: the couplet rules of issue 21 and the quality measures.

Oracles: classic couplets checked by hand (天若有情天亦老 / 月如无恨月常圆, Li He's line and the
answer it is famous for: 天…天 in the 上联 answered by 月…月), tones from a dictionary (老 lǎo,
圆 yuán, 春 chūn, 福 fú), violations built by hand, n-gram counts done by hand.
"""
from __future__ import annotations

import pytest

pytest.importorskip("pypinyin")

from leapfrog.couplet.rules import (  # noqa: E402
    RULES, all_hold, allowed_next, check, hanzi, is_level, is_oblique, level_and_oblique,
    repeat_violations, split_keywords, tone, tones,
)

UP, DOWN = "天若有情天亦老", "月如无恨月常圆"


def test_hanzi_drops_punctuation_and_space():
    assert hanzi("春回大地，福满人间。") == "春回大地福满人间"
    assert hanzi(" 马年\t吉祥！\n") == "马年吉祥"
    assert hanzi("") == ""


@pytest.mark.parametrize("char, expected", [("老", 3), ("圆", 2), ("春", 1), ("福", 2), ("岁", 4), ("天", 1)])
def test_tone_of_single_characters(char, expected):
    assert tone(char) == expected


def test_tone_non_cjk_and_neutral():
    assert tone("a") is None and tone("，") is None and tone("1") is None
    assert tone("的") == 5                              # neutral tone: neither level nor oblique
    assert not is_level("的") and not is_oblique("的")


def test_level_and_oblique_characters():
    assert is_level("春") and is_level("圆") and not is_oblique("圆")
    assert is_oblique("老") and is_oblique("岁") and not is_level("老")


def test_context_picks_the_reading_of_a_heteronym():
    assert tones("长城") == [2, 2]                      # chang2 cheng2
    assert tone("长", context="长城") == 2
    assert tone("长") == 3                              # alone: pypinyin's default, zhang3
    assert tones("春，风") == [1, None, 1]              # one entry per character, punctuation None
    assert tone("福", context="万福") == 2              # no heteronym: context changes nothing


def test_level_and_oblique_on_a_tiny_vocabulary():
    vocab = ["<unk>", "<s>", "春", "老", "圆", "，", "a", "的", "福", "岁", "", "新年", "大地"]
    level, oblique = level_and_oblique(vocab)
    assert level == [2, 4, 8, 11]                       # 春 圆 福 新年(nian2)
    assert oblique == [3, 9, 12]                        # 老 岁 大地(di4)


def test_classic_couplet_keeps_every_rule():
    rules = check(UP, DOWN, "天长地久", ["天", "月圆"])
    assert set(rules) == set(RULES)
    assert all(rules.values()), rules
    assert all_hold(rules)
    assert check("天若有情天亦老，", "月如无恨月常圆。", "天长地久", [])["equal_length"]


def test_each_rule_fails_on_its_own():
    assert not check(UP, "月如无恨月常", "天长地久", [])["equal_length"]
    assert not check(UP, UP, "天长地久", [])["no_repeat"]
    assert not check(UP, "月如无恨月亦圆", "天长地久", [])["no_repeat"]     # 亦 at the 上联's place
    assert not check(UP, "月如无恨月常月", "天长地久", [])["repeat_pattern"]  # 月 at 0, 4 and 6; 天 at 0, 4 only
    assert not check(UP, DOWN, "天长地久", ["马年"])["keywords"]
    assert not check("天若有情天亦新", DOWN, "天长地久", [])["tone"]            # 上联 ends level
    assert not check(UP, "月如无恨月常好", "天长地久", [])["tone"]             # 下联 ends oblique
    assert not check(UP, DOWN, "天长", [])["horizontal_4"]
    assert not all_hold(check(UP, DOWN, "天长", []))
    empty = check("", "", "", [])
    assert not empty["equal_length"] and not empty["no_repeat"] and not empty["tone"]


def test_keywords_may_sit_in_the_horizontal_scroll():
    assert check(UP, DOWN, "吉祥如意", ["吉祥"])["keywords"]
    assert not check(UP, DOWN, "吉祥如意", ["吉祥", "马"])["keywords"]


def test_repeat_violations():
    assert repeat_violations(UP, DOWN) == []
    assert repeat_violations("春风得意", "花花世界") == [(0, 1)]
    assert repeat_violations(UP, "月如无恨月常月") == [(0, 6), (4, 6)]
    assert repeat_violations("花花世界", "春风得意") == []   # the 上联 repeating alone is not listed


def test_allowed_next_mirrors_the_upper_line():
    must, banned = allowed_next(UP, "")
    assert must is None and banned == {"天"}
    must, banned = allowed_next(UP, "月如")
    assert must is None and banned == {"有", "月", "如"}
    must, _ = allowed_next(UP, "月如无恨")                  # the 上联 repeats 天 here
    assert must == "月"
    must, banned = allowed_next(UP, "月如无恨月")
    assert must is None and banned == {"亦", "月", "如", "无", "恨"}
    assert allowed_next(UP, DOWN) == (None, set())          # the line is complete
    assert allowed_next("春回，大地", "秋至，")[1] == {"大", "秋", "至"}   # punctuation does not count


def test_allowed_next_builds_the_classic_answer():
    """Every character of 月如无恨月常圆 is allowed at its place, given the ones before."""
    for k, c in enumerate(DOWN):
        must, banned = allowed_next(UP, DOWN[:k])
        assert (must == c) if must else (c not in banned), (k, c)


def test_split_keywords():
    assert split_keywords("马年 吉祥") == ["马年", "吉祥"]
    assert split_keywords(" 马年，吉祥、福;春  春\u3000新岁 ") == ["马年", "吉祥", "福", "春", "新岁"]


@pytest.mark.parametrize("text, words", [
    ("", "请输入关键词"), ("  ，、 ", "no keywords"),
    ("一 二 三 四 五 六 七 八 九", "too many keywords"),
    ("一二三四五六七八九", "at most 8"),
    ("hello world", "no Chinese character"),
    ("<b>马年</b>", "Chinese characters only"),
    ("马年2026", "Chinese characters only"),
    ("一二三四五六七 八九十一二三四 五六七", "too many characters"),
    ("马" * 300, "too long"),
])
def test_split_keywords_refuses(text, words):
    with pytest.raises(ValueError, match=words):
        split_keywords(text)


def test_distinct_n():
    from leapfrog.couplet.quality import distinct_n
    assert distinct_n([], 2) == 0.0
    assert distinct_n(["春"], 2) == 0.0
    assert distinct_n(["春春春", "春春"], 1) == pytest.approx(1 / 5)
    assert distinct_n(["天地人", "人地天"], 2) == 1.0
    assert distinct_n(["天地天地"], 2) == pytest.approx(2 / 3)       # 天地 地天 天地
    assert distinct_n(["天，地"], 2) == 1.0                           # punctuation does not count


def test_pos_parallelism():
    pytest.importorskip("jieba")
    from leapfrog.couplet.quality import pos_parallelism
    assert pos_parallelism(UP, UP) == 1.0
    assert pos_parallelism("春回大地，福满人间", "春回大地，福满人间") == 1.0
    assert pos_parallelism("", DOWN) == 0.0
    assert 0.0 <= pos_parallelism(UP, DOWN) <= 1.0


def test_summarise():
    from leapfrog.couplet.quality import summarise
    good = dict(check(UP, DOWN, "天长地久", []), pos=1.0, seconds=0.5)
    bad = dict(check(UP, "月如无恨月常好", "天长", []), pos=0.5, seconds=1.5)
    s = summarise([good, bad])
    assert s["n"] == 2 and s["equal_length"] == 1.0
    assert s["tone"] == 0.5 and s["horizontal_4"] == 0.5 and s["all"] == 0.5
    assert s["pos"] == pytest.approx(0.75) and s["seconds"] == pytest.approx(1.0)
    assert summarise([]) == {"n": 0}
