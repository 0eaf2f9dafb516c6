"""``python -m wsd.worker``: see ``wsd.worker.process``."""

import sys

from wsd.worker.process import main

if __name__ == "__main__":
    sys.exit(main())
