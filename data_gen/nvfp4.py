"""Stage CLI: ``python -m data_gen.nvfp4`` converts a target to NVFP4 (the work is :mod:`eagle3.nvfp4`'s).

    python -m data_gen.nvfp4 --target smollm2-135m --calibration runs/pools/train.jsonl --out runs/nvfp4/smollm2

The output folder is then a target like any other (``target.name_or_path=<out>``): the harvester,
the regenerator, training and the serving loop run it emulated, W4A4 as Blackwell computes it.
"""

from __future__ import annotations

import sys

from eagle3.nvfp4 import main

if __name__ == "__main__":
    sys.exit(main())
