"""Makes this folder's process harness and the MoE float64 reference importable, in the test
process and in the processes it spawns (pytest runs in importlib mode)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for folder in (HERE, os.path.join(os.path.dirname(HERE), "moe")):
    if folder not in sys.path:
        sys.path.insert(0, folder)
