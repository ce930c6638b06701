#!/usr/bin/env bash
# moe_fusion choice sweeps (fused vs unfused moe_mlp, grid of 2, 3 samples) for the shipped CPU table, each
# under benchmarks/memwatch.py (peak PSS of the sweep and its workers) and next to sweep_memory's estimate.
# Usage: moe_fusion_sweeps.sh DIRECTION WORKERS PROFILE_DIR "TOKENS EP DTYPE PRESET" ...
#   PRESET: qwen3 (hidden 2048, intermediate 768, 128 experts, top_k 8) or deepseek (2048, 1408, 64, 6).
# Run it under the bench lock: flock /work/coord/bench.lock benchmarks/moe_fusion_sweeps.sh ...
set -u
direction=$1 workers=$2 profile_dir=$3; shift 3
py=.venv/bin/python
for spec in "$@"; do
  read -r tokens ep dtype preset <<<"$spec"
  case $preset in
    qwen3) dims="--hidden 2048 --intermediate 768 --experts 128 --top-k 8"; f=768 e=128 k=8 ;;
    deepseek) dims="--hidden 2048 --intermediate 1408 --experts 64 --top-k 6"; f=1408 e=64 k=6 ;;
  esac
  estimate=$($py -c "from moe_tune.layer.fusion_choice import FusionProblem, sweep_memory as m
print(f'{m(FusionProblem(tokens=$tokens, hidden=2048, intermediate=$f, experts=$e, top_k=$k, ep=$ep, dtype=\"$dtype\", direction=\"$direction\"), $workers) / 2**30:.2f}')" 2>/dev/null)
  echo "=== $direction tokens=$tokens ep=$ep dtype=$dtype $preset workers=$workers estimate_GiB=$estimate $(date -u +%H:%M:%S) $(uptime)"
  free -m | sed -n 2p
  $py benchmarks/memwatch.py .venv/bin/moe-tune sweep --op moe_fusion --tokens "$tokens" $dims --ep "$ep" \
    --dtype "$dtype" --direction "$direction" --strategy grid --samples 3 --workers "$workers" \
    --profile-dir "$profile_dir" 2>&1 | grep -E "winner|default  |speedup|verdict|wall time|candidates|MEMWATCH|rror"
done
echo "=== done $(date -u +%H:%M:%S) $(uptime)"
