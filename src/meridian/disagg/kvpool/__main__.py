"""``python -m meridian.disagg.kvpool``: run a KV pool (:func:`meridian.disagg.kvpool.main`)."""

from __future__ import annotations

import sys

# The pool's code lives in the package's modules, imported under their canonical names, so the
# fabrics (which import meridian.disagg.kvpool) and the server share one copy of its classes;
# this file only runs main.
from meridian.disagg.kvpool.process import main

if __name__ == "__main__":
    sys.exit(main())
