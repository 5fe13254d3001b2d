"""Measuring a model and the modes: held-out evaluation (`orbit eval`, eval.py) and the five-panel
bench (`orbit bench`, bench.py)."""
