"""Parallel training: device mesh, FSDP2 / tensor-parallel sharding applied from outside the
model, and a Ray worker group running SPMD training (docs/parallel.md).

Modules: `distributed` (process group setup, local spawner), `mesh` (`build_device_mesh`),
`plans` (TP plans per architecture), `apply` (`apply_parallelism`), `grad_norm` (norm and
clipping across meshes), `workers` (`run_workers`, Ray). The training loop every worker runs
is the recipes' own (`posttrain.steps.train.train_loop`).
Import the module you need: importing this package loads neither Ray nor the TP styles.
"""
