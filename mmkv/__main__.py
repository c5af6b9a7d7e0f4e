"""``python -m mmkv``: the ``mmkv`` command (see ``mmkv.cli``)."""

import sys

from .cli import main

sys.exit(main())
