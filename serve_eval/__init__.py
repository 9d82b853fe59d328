"""Stage: speculative decoding with a trained draft, acceptance length and tokens/s reports.

A thin stage over the ``eagle3`` library; never imports the other stage packages.
"""
