"""Stage: prompt pools, target-regenerated responses and hidden-state harvesting.

A thin stage over the ``eagle3`` library; never imports the other stage packages.
"""
