import sys

from clusterlm.cli.commands import main

sys.exit(main())
