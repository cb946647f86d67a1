"""Choosing the carve by measurement: keep-sets of several criteria and counts scored by masking."""
