"""The Spring Festival couplet terminal (春联): the couplet rules (rules.py), the quality measures
(quality.py), and the page at /couplet (serve/static/couplet.html). Pure Python, no torch."""
