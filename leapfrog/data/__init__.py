"""Data helpers below training, evaluation and benchmarks: the corpus and its held-out split, and
the story and couplet text formats."""
