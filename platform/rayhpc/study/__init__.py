"""One sweep across many Ray clusters: a study folder on a shared filesystem that slices come and go on.

`rayhpc tune --study DIR` makes this process a slice of the study in DIR: it runs the study's sweep on its
own Ray cluster (local, `--address`, or a Slurm job's), packing trials as any sweep does, claiming packs
from the study and recording their rows there. Slices may start at any time and be killed at any time;
every trial ends exactly once (`rayhpc.study.folder`). `rayhpc status --study DIR` shows the whole sweep.
This folder holds the study's own files (the ledger, its lock, the slices' identity: `folder`, `slice`); a slice's
Tune searcher and a study's Slurm array tasks are sweeps, in `rayhpc.tune` (`slice_search`, `study_array`).
"""
