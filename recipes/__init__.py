"""Hydra recipes and the pipeline entry point (``eagle3-run``): ``pipeline.yaml`` and its groups
(``draft/``, ``target/``, ``scale/``, ``launcher/``) over the dataclasses of :mod:`recipes.config`."""
