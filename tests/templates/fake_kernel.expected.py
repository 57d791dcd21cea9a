"""A stand-in kernel module for the tuner/database tests (plain Python, no GPU)."""

TILE = 16
STAGES = 2
PACK = "a"
SPLIT = True
N = 512
K = 1024
FAIL = None
REGISTERS = 48


def entry(x):
    return [TILE * v for v in x]
