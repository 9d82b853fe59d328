"""Hydra recipes and the pipeline entry point (``eagle3-run``)."""
