#!/usr/bin/env bash
# Issue 5's H200 figures: async's output check on CUDA, the bundled-pair table (ar, chain, tree,
# async; both workloads, with the async timeline), and the realistic-shape comparison with
# acceptance replayed from the MBPP run (simulated acceptance).
#   TANDEM_COMMIT=<sha> bash bench/run_h200_async.sh $OUT          (device tool: carry .data)
#   SKIP_REPLAY=1 leaves out the realistic-shape replay (the longest part)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
echo "== async vs ar, every pass checked against an uncached forward"
timeout 150 python3 bench/gpu_async_check.py --out "$OUT/check" --num-prompts 12 --max-new-tokens 128 \
  --variants streams,base 2>&1 | grep "^=="
for wl in mbpp source; do
  echo "== bundled pair, $wl"
  timeout 200 python3 -m tandem bench --device cuda --dtype float32 --workload $wl --data-dir .data --num-prompts 20 \
    --max-new-tokens 128 --methods ar,chain,tree,async --warmup 2 --max-prompt-tokens 384 \
    --out "$OUT/bench_$wl" 2>&1 | grep -v -e "it/s" -e "req/s" -e "^tandem async" | tail -16
done
echo "== collapse: the bundled target with a random-weight draft of the bundled draft's shape (acceptance ~0)"
python3 - "$OUT/random_draft" <<'PY'
import shutil, sys, torch
from safetensors.torch import load_file, save_file
from tandem.runtime.pair import BUNDLED_DRAFT
out = sys.argv[1]
shutil.copytree(BUNDLED_DRAFT, out, dirs_exist_ok=True)
g = torch.Generator().manual_seed(0)
w = load_file(f"{out}/model.safetensors")
save_file({k: (torch.randn(v.shape, generator=g) * v.float().std()).to(v.dtype) if v.dim() > 1 else v
           for k, v in w.items()}, f"{out}/model.safetensors")
PY
timeout 150 python3 -m tandem bench --device cuda --dtype float32 --workload mbpp --data-dir .data --num-prompts 10 \
  --max-new-tokens 128 --methods ar,tree,async --warmup 2 --max-prompt-tokens 384 --draft "$OUT/random_draft" \
  --no-plots --out "$OUT/bench_collapse" 2>&1 | grep -v -e "it/s" -e "req/s" -e "^tandem async" | tail -12
rm -rf "$OUT/random_draft"
[ "${SKIP_REPLAY:-0}" = 1 ] || {
echo "== llama3-8b / llama3.2-1b, bf16, acceptance replayed from bench_mbpp (simulated)"
timeout 220 python3 -m tandem bench --device cuda --dtype bfloat16 --preset llama3-8b --draft-preset llama3.2-1b \
  --replay "$OUT/bench_mbpp/results.json" --methods ar,tree,async --num-prompts 6 \
  --no-plots --out "$OUT/replay_llama3-8b" 2>&1 | grep -v -e "it/s" -e "^tandem bench (sim" -e "^tandem async: trial" | tail -16
}
# one archive: the device tool brings back a limited number of files
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
