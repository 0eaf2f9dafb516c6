"""``python -m wsd.worker``: see ``wsd.programs.worker``."""

import sys

from wsd.programs.worker import main

if __name__ == "__main__":
    sys.exit(main())
