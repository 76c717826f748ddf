"""``python -m secondorder``: see :mod:`secondorder.cli`."""

import sys

from .cli import main

sys.exit(main())
