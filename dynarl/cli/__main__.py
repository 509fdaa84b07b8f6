"""``python -m dynarl.cli``: the ``dynarl`` command."""

import sys

from dynarl.cli import main

sys.exit(main())
