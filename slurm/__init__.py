"""sbatch templates for hpcdl (skx, knl, generic) and the renderer that validates a job
before it is queued (`hpcdl slurm render`, docs/slurm.md)."""
