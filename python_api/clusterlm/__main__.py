"""``python -m clusterlm``: the ``clusterlm`` command (:func:`clusterlm.cli.commands.main`)."""

from clusterlm.cli.commands import main
from clusterlm.launch.exiting import run_and_exit

run_and_exit(main)
