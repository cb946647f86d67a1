"""Evaluation of models against a reference: perplexity, KL divergence, QA checks, speed, gate, summary."""
