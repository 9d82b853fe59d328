"""The trainer: the loop and its CLI (``loop``, ``python -m eagle3.train``), its setup, one step
(``step``), the optimizers (``optim``), checkpoints, logs, and a draft's size before any weights
(``size``)."""
