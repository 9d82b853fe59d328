"""``python -m eagle3.train``: the trainer's command line (:func:`eagle3.train.loop.main`)."""

import sys

from eagle3.train.loop import main

sys.exit(main())
