"""Stage: find where the draft is weak, mine more such data, feed it back in rounds.

A thin stage over the ``eagle3`` library; never imports the other stage packages.
"""
