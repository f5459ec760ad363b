import sys

from clusterlm.cli import main

sys.exit(main())
