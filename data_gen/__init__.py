"""Stage: prompt pools, target-regenerated responses and hidden-state harvesting.

A stage over the ``eagle3`` core; it imports no later stage (the chain ``eagle3 -> data_gen -> serve_eval
-> hard_mining -> recipes``, checked by ``tests/test_layout.py``).
"""
