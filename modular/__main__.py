"""``python -m modular``: the ``modular`` command."""

import sys

from modular.app.cli import main

sys.exit(main())
