"""Run a command and report the peak memory of its process tree: the sum of every process's PSS (/proc/PID/smaps_rollup,
shared pages split between their users) polled every 0.25 s, and the moe_tune shared-memory payload files
the tree's (/dev/shm/moe_tune_shared_<pid>_*). Usage: memwatch.py COMMAND ARGS... (its exit status is the command's)."""
import os, subprocess, sys, time, glob
def tree(pid):
    out = [pid]
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            for c in open(f"/proc/{pid}/task/{t}/children").read().split():
                out += tree(int(c))
    except OSError: pass
    return out
def pss(pid):
    try:
        for l in open(f"/proc/{pid}/smaps_rollup"):
            if l.startswith("Pss:"): return int(l.split()[1]) * 1024
    except OSError: pass
    return 0
proc = subprocess.Popen(sys.argv[1:])
peak = peak_shm = peak_tot = 0; n = 0
while proc.poll() is None:
    pids = tree(proc.pid)
    total = sum(pss(p) for p in pids)
    # the payload files this tree wrote (moe_tune_shared_<pid>_*), not other sweeps'
    files = [f for p in pids for f in glob.glob(f"/dev/shm/moe_tune_shared_{p}_*")]
    shm = sum(os.path.getsize(f) for f in files if os.path.exists(f))
    peak, peak_shm, peak_tot = max(peak, total), max(peak_shm, shm), max(peak_tot, total + shm)
    n = max(n, len(pids))
    time.sleep(0.25)
print(f"MEMWATCH rc={proc.returncode} peak_pss_GiB={peak/2**30:.2f} peak_shm_GiB={peak_shm/2**30:.2f} "
      f"peak_pss_plus_shm_GiB={peak_tot/2**30:.2f} max_procs={n}", flush=True)
sys.exit(proc.returncode)
