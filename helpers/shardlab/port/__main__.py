"""``python -m shardlab.port``: see ``shardlab/port/__init__.py``."""

import sys

from .cli import main

sys.exit(main())
