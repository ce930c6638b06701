"""Tuning campaigns: one typed request (`request.Campaign`: the kernel cases, the sweeps' settings, where it
runs, its passes) planned once (`plan`: models x token counts x ep x kernels x directions, one sweep per table
key) and run by `runner`: here, on Ray (one accelerator per sweep, `ray_runner`) or as a share for job arrays
(`plan.shard`), then the ladders' boundaries (`ladder`) and the robust choice (`robust`); or compiled for a
chip (`target`)."""
