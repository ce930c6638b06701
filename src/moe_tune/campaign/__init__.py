"""Tuning campaigns: many sweeps (models x token counts x ep x kernels x directions) planned once, then run on
Ray (one accelerator per sweep, `ray_runner`) or split into shares for job arrays (`plan.shard`)."""
