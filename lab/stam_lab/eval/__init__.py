"""Evaluation: write-time state diagnostics, QA metrics and paired tests (stam eval)."""
