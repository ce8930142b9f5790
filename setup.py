"""hpcdl: large-batch ImageNet training on CPU supercomputers with MPI.

torch is pinned exactly: a looser range makes pip fetch a multi-GB CUDA build on machines
where only the CPU wheel is wanted (and on a cluster the CPU wheel is what a Xeon node uses).
"""
from setuptools import find_packages, setup

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
        "mpi4py",
        # Wheel with MPICH's mpiexec, so one machine needs no system MPI. On a cluster, build
        # mpi4py against the site MPI instead (README: "Using the site MPI").
        "mpich",
        "pyyaml",
        "pillow",
        "simplejpeg",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "ruff", "webdataset"],
        # Baselines a bench compares against (hpcdl bench loader: WebDataset).
        "bench": ["webdataset"],
        # Optional Intel accelerators. Both are archived upstream and have no wheel for
        # torch 2.13; install the builds matching your torch on the cluster by hand. hpcdl
        # detects them at run time and never needs them.
        "intel": ["intel-extension-for-pytorch", "oneccl_bind_pt"],
    },
    entry_points={"console_scripts": ["hpcdl=hpcdl.cli.main:main"]},
)
