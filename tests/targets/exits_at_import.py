"""A module that ends the process while it is imported (a script guard written as sys.exit)."""

import sys

sys.exit(3)


def build():
    raise AssertionError("never reached")
