"""hpcdl: large-batch ImageNet training on CPU supercomputers with MPI."""

__version__ = "0.1.0"
