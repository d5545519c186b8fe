"""Makes the float64 reference of this folder importable by its tests (pytest runs in importlib mode)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
