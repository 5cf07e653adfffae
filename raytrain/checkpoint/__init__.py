"""Training checkpoints: names and retention (`layout`), the crash-safe store (`store`).

Why not Ray Train's own checkpoint API (``ray.train.report(checkpoint=Checkpoint.from_directory(d))`` with
``RunConfig(storage_path=...)`` and ``CheckpointConfig(num_to_keep=...)``)? The train loop reports metrics to Ray
and no checkpoints; ours add what that API does not have:

- the exact data position: every manifest records the step and the global micro-batch a resumed run starts from
  (raytrain.trainer.schedule.data_position), checked against the batch layout on resume, with the config, its hash
  and the software versions;
- manifest-last commit on a shared mount: the ranks write straight into one step folder on the shared filesystem
  (or object store), hash their share of the files, and one rank writes the manifest last and publishes the step
  by an atomic rename; Ray copies each rank's directory to storage, with no per-file hashes to verify a load against;
- a run lock (raytrain.runlock): one job owns a run folder, so two never interleave checkpoints.

Retention (keep the newest K, the best by a metric, and never the one a run resumed from) is ours because Ray's
``CheckpointConfig`` only manages checkpoints reported through ``ray.train.report``.
"""
