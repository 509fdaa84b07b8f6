"""``python -m dynarl.runtime.worker``: one worker process (see :func:`main`)."""

from __future__ import annotations

import sys

from dynarl.runtime.worker._entry import main

if __name__ == "__main__":
    sys.exit(main())
