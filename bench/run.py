"""python bench/run.py [family ...]: the same as ``python -m bench``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
