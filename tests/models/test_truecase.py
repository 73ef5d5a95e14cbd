"""Truecasing the lowercased TinyStories file (leapfrog.data.truecase): the oracle is the cased
original, lowercased and restored."""
from __future__ import annotations

import shutil

from leapfrog.data import corpus as data
from leapfrog.data.truecase import CasingTable

CASED = [
    "Once upon a time, there was a girl named Lily. Lily had a dog called Spot. "
    "Every day Lily and Spot played in the park with Ben.",
    "One day, Ben saw a big red ball. \"Can I play too?\" he asked Lily. "
    "\"Yes,\" said Lily. \"I like to share.\"",
    "The sun was hot. Mom gave Ben and Lily some water. The dog ran to the tree. "
    "After that, Spot was tired and the kids went home with Mom. Then Mom smiled at them.",
]


def test_a_lowercased_story_gets_its_capitals_back():
    table = CasingTable.learn(CASED)
    # names and "I" take their cased form; "the", which starts two sentences, stays lower case
    assert table.forms["lily"] == "Lily" and table.forms["spot"] == "Spot" and table.forms["i"] == "I"
    assert "the" not in table.forms and "one" not in table.forms
    for story in CASED:
        assert table.apply(story.lower()) == story


def test_sentences_quotes_and_names_after_named():
    table = CasingTable.learn(CASED)
    text = ('"ow, that hurts!" he cried. spot barked. "can i help?" she asked.\n'
            'they named the kitten. a cat named snowy slept. "yes." then lily laughed.')
    want = ('"Ow, that hurts!" he cried. Spot barked. "Can I help?" she asked.\n'
            'They named the kitten. A cat named Snowy slept. "Yes." Then Lily laughed.')
    # "the" after "named" is a word the cased stories write in lower case: no capital;
    # "snowy" is unknown to them, so after "named" it is a name.
    assert table.apply(text) == want


def test_a_form_needs_a_clear_majority():
    """A word capitalised only sometimes away from sentence starts (Mom / mom) keeps its case."""
    table = CasingTable.learn(["Her mom said hi. Mom laughed. Then her mom ran. Mom sat down."])
    assert "mom" not in table.forms


def test_truecased_training_keeps_the_tokenizer_and_the_validation_split(data_dir, tmp_path, private_cache):
    from leapfrog.train.prepare import prepare
    from leapfrog.train.recipes import tiny

    root = tmp_path / "data"
    shutil.copytree(data_dir, root)
    cased = data.read_stories(root / "stories" / "tinystories_cased.txt")
    with open(root / "stories" / "tinystories_lowercase.txt", "w") as f:
        f.writelines(f"{s.lower()}\n{data.END_OF_TEXT}\n" for s in cased)
    cfg = tiny("stories")
    plain = prepare("stories", cfg.tokenizer, str(root), cfg.seed, cfg.model.max_position)
    cased_too = prepare("stories", cfg.tokenizer, str(root), cfg.seed, cfg.model.max_position, truecase=True)
    assert cased_too.tokenizer_dir != plain.tokenizer_dir
    assert (cased_too.tokenizer_dir / "tokenizer.json").read_text() == \
        (plain.tokenizer_dir / "tokenizer.json").read_text()
    assert list(cased_too.val) == list(plain.val)
    assert cased_too.num_train_items == plain.num_train_items and list(cased_too.train) != list(plain.train)
    lowered = data.train_items("stories", str(root))["stories"]
    restored = data.train_items("stories", str(root), truecase=True)["stories"]
    n = len(data.train_items("stories", str(root))["stories"]) - sum(
        1 for s in data.read_stories(root / "stories" / "tinystories_lowercase.txt")
        if not data.is_heldout(s, "stories"))
    assert restored[:n] == lowered[:n]                      # the cased files are untouched
    assert any(r != low for r, low in zip(restored[n:], lowered[n:]))
    assert all(r.lower() == low for r, low in zip(restored[n:], lowered[n:]))


def test_leapfrog_train_truecase_flag(data_dir, tmp_path, private_cache):
    """`leapfrog train <stories recipe> --truecase` trains on the restored text and records it;
    on the couplets data it is a usage error."""
    import pytest

    from leapfrog.train.cli import config_for
    from leapfrog.train.loop import train

    cfg, _ = config_for(["tiny", "--truecase", "--data-dir", str(data_dir), "--steps", "2",
                         "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run")])
    assert cfg.truecase and " --truecase " in cfg.command
    summary = train(cfg)
    assert summary["config"]["truecase"] is True and summary["steps"] == 2
    assert not config_for(["stories-polish"])[0].truecase
    with pytest.raises(SystemExit):
        config_for(["couplets", "--truecase"])
