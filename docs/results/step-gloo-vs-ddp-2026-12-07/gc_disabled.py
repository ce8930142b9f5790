"""`hpcdl` with Python's cyclic garbage collector off from the start (every mode alike)."""
import gc
import runpy
import sys

gc.disable()
sys.argv = ["hpcdl", *sys.argv[1:]]
runpy.run_module("hpcdl.cli.main", run_name="__main__")
