"""An entry point's imports without the garbage collector's repeated full collections.

Importing torch and DeepSpeed makes about 400,000 objects that live as long as the process and leave next to no
garbage, yet while they load the collector walks all of them again at each of its full collections: measured here,
a fifth of a rank's start-up CPU time and a quarter of deepy.py's. Entry points import them inside
`collector_paused()`: the collector is off meanwhile, and afterwards never walks what was imported (CPython's
gc.freeze, as pre-forking servers use it), so that later imports (torch._dynamo with the first optimizer) are cheap
too.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
