"""``python -m tunelab.cli``: the same as the ``tunelab`` command."""

import sys

from . import main

sys.exit(main())
