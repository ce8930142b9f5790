import gc, runpy, sys
gc.disable()
sys.argv = ["hpcdl"] + sys.argv[1:]
runpy.run_module("hpcdl.cli.main", run_name="__main__")
