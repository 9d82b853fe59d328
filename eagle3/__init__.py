"""EAGLE-3 draft-head training: the library every stage calls.

Target loading and aux-layer capture (``eagle3.target``), target sources
(``eagle3.target_source``), atomic file writes (``eagle3.atomic``) and the typed config
tree (``eagle3.config``).
"""

__version__ = "0.1.0"
