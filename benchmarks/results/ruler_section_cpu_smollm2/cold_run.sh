#!/bin/bash
cd /work/main
. /work/venv/bin/activate
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
uptime
/usr/bin/time -v python -m experiments.report --model smollm2 \
  --budgets 128,256,512 --ruler-length 4096 --ruler-tasks niah_single_1,niah_multikey_2,niah_single_2_stdlib \
  --ruler-samples 10 --ruler-ratios 0.5,0.875 --ruler-batch 5 --chat-template auto \
  --ruler-methods streaming,h2o,snapkv,pyramidkv,slimkv,tova,knorm,adakv,expected-attention,keydiff,kvzip,duo \
  --skip perplexity,razor,longbench,zeroshot,passkey,efficiency,quantization --out $1 &
pid=$!
( while kill -0 $pid 2>/dev/null; do c=$(pgrep -P $pid python | head -1); [ -n "$c" ] && echo "$(date +%T) maps $(wc -l < /proc/$c/maps 2>/dev/null) rss_kb $(grep VmRSS /proc/$c/status 2>/dev/null | awk '{print $2}')"; sleep 30; done ) > $1.maps &
wait $pid
date; uptime
