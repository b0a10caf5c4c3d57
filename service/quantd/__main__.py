"""``python -m quantd`` is the ``quantd`` command."""

from quantd.cli import run

run()
