"""Evaluation scripts and the synthetic task suite they run on."""
