"""``python -m clusterlm.train ARGS`` (also ``torchrun -m clusterlm.train``, ``accelerate launch -m clusterlm.train``):
the ``clusterlm train`` command, for launchers that start a module rather than a console script.

It holds no code of its own. In Python, train with :func:`clusterlm.train` (:func:`clusterlm.training.run.train`) on
a :class:`clusterlm.TrainConfig`; the rank's loop is :mod:`clusterlm.training.loop`.
"""

import sys

if __name__ == "__main__":
    from clusterlm.cli.commands import main
    from clusterlm.launch.exiting import run_and_exit

    run_and_exit(lambda: main(["train", *sys.argv[1:]]))
