"""Training checkpoints: names and retention (`layout`), the crash-safe store (`store`).

Ours, not Ray Train's checkpoint API: a manifest records the exact data position a resumed run starts from, the
ranks commit into one step folder with per-file hashes and the manifest written last, and a run lock keeps one job
per run folder (docs/decisions.md, 'Checkpoints of our own, not through Ray Train').
"""
