"""EAGLE-3 draft-head training: the library every stage calls.

Its parts, each importing only from itself and the parts before it (``tests/test_layout.py``):

- the root: errors (``errors``), atomic writes (``atomic``), devices (``device``,
  ``distributed``), the shared settings (``config``), caches (``home``), fingerprints, the CLI
  generator (``cli``), the wandb layout (``dashboards``);
- ``eagle3.target``: where a target comes from and how it loads, runs and captures its aux states;
- ``eagle3.draft``: the draft's layers, its families, its vocabulary, the training-time test and
  its losses and metrics, the engines' folder formats;
- ``eagle3.store``: the harvest store, plans, the online spool, co-located capture, the batches;
- ``eagle3.export``: export and import of draft folders;
- ``eagle3.train``: the trainer, its setup, optimizer, checkpoints and logs.
"""

__version__ = "0.1.0"
