"""``python -m modular``: the ``modular`` command."""

import sys

from modular.app.cli import main

if __name__ == "__main__":  # not when imported again as a process's main module (multiprocessing's spawn)
    sys.exit(main())
