"""``python -m dynarl.runtime.launch``: one torchrun rank of a launched job (see :func:`main`)."""

from __future__ import annotations

import sys

from dynarl.runtime.launch._torchrun import main

if __name__ == "__main__":
    sys.exit(main())
