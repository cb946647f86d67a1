"""Pruning: a plan of byte ranges (pure data), its execution under temp names, the check of every tensor and key, and
the report."""
