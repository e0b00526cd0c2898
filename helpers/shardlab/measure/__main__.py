import sys

from .tables import main

sys.exit(main())
