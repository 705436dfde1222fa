"""Trace ingestion, teacher-replay pair mining and the collator (issue #3)."""
