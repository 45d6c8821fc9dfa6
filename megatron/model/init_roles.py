"""What a parameter is, for its initialisation: one of the config's two GPT-NeoX init methods, or a constant.

Modules and the Pattention spec (spec.py) say which role each parameter has; init_methods.py says how
each role is drawn.
"""

from enum import Enum


class InitRole(Enum):
    """How a parameter is initialised: by one of the config's init methods, or to a constant."""

    INPUT = "init_method"
    OUTPUT = "output_layer_init_method"
    ONES = "ones"
    ZEROS = "zeros"
