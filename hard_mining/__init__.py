"""Stage: find where the draft is weak, mine more such data, feed it back in rounds.

A stage over ``eagle3``, ``data_gen`` and ``serve_eval``; only ``recipes`` comes after it (the chain
is checked by ``tests/test_layout.py``).
"""
