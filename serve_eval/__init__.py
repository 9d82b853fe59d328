"""Stage: speculative decoding with a trained draft, acceptance length and tokens/s reports.

A stage over the ``eagle3`` core and ``data_gen``; it imports no later stage (the chain ``eagle3 ->
data_gen -> serve_eval -> hard_mining -> recipes``, checked by ``tests/test_layout.py``).
"""
