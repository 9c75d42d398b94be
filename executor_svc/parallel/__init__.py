"""Executor groups: one logical executor over several ranks (tensor and pipeline parallel; docs/parallel.md)."""
