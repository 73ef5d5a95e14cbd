"""`leapfrog eval`: quality metrics for a model and decoding method (evaluate.py), on text metrics
(metrics.py)."""
