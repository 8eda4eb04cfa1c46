"""``python -m tunelab``: the same as the ``tunelab`` command."""

import sys

from .cli import main

sys.exit(main())
