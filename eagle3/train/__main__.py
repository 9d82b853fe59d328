"""``python -m eagle3.train``: the trainer's command line (:func:`eagle3.train.loop.main`)."""

import sys

from eagle3.distributed import shutdown
from eagle3.train.loop import main

try:
    code = main()
finally:
    shutdown()  # the process groups go before the interpreter does (eagle3.distributed.shutdown)
sys.exit(code)
