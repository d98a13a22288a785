#!/bin/bash
# Issue 9's serving rows against the vLLM anchor: one round for one server — start it (time to /v1/models),
# then vLLM's own client for both servers (random 256 in / 128 out, ignore_eos: c=16 x 64, then c=1 x 8),
# peak RSS/PSS of the server's process tree during c=16 (loadtest/tree_rss.py). Results in $OUT_DIR.
# usage: loadtest/vs_anchor_serve.sh ours|vllm TAG   (OURS_ARGS="--quantization none", OURS_ENV="VAR=1")
set -u
WHO=$1; TAG=$2; ROOT=$(cd "$(dirname "$0")/.." && pwd); A=${ANCHORS:-$ROOT/../shared/anchors}; OUT=${OUT_DIR:-/tmp/pagedserve-vs}/serve-$WHO-$TAG; mkdir -p $OUT
cd "$ROOT"
if [ $WHO = ours ]; then PORT=8000; setsid env ${OURS_ENV:-X=1} .venv/bin/pagedserve serve --host 127.0.0.1 --port $PORT --served-model-name smollm2 ${OURS_ARGS:-} > $OUT/server.log 2>&1 &
else PORT=8011; setsid bash $A/vllm-cpu.sh serve $PORT > $OUT/server.log 2>&1 & fi
SPID=$!; T0=$(date +%s.%N)
until curl -sf http://127.0.0.1:$PORT/v1/models >/dev/null; do sleep 0.1; if ! kill -0 $SPID 2>/dev/null; then echo "server died"; tail $OUT/server.log; exit 1; fi; done
T1=$(date +%s.%N); echo "$WHO cold start to /v1/models: $(echo "$T1 - $T0" | bc) s  load $(cut -d' ' -f1-3 /proc/loadavg)" | tee $OUT/summary
.venv/bin/python loadtest/tree_rss.py $SPID $OUT/rss16 & RP=$!
bash $A/vllm-cpu.sh bench $PORT 16 64 > $OUT/c16.log 2>&1
kill $RP; sleep 0.5
echo "c16 load $(cut -d' ' -f1-3 /proc/loadavg) $(cat $OUT/rss16)" | tee -a $OUT/summary
grep -E "Output token throughput|Median TTFT|Median TPOT|P99 TPOT|Successful|Mean TTFT" $OUT/c16.log | tee -a $OUT/summary
bash $A/vllm-cpu.sh bench $PORT 1 8 > $OUT/c1.log 2>&1
echo "c1 load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $OUT/summary
grep -E "Output token throughput|Median TTFT|Median TPOT|P99 TPOT|Successful" $OUT/c1.log | tee -a $OUT/summary
kill -TERM -- -$SPID 2>/dev/null; sleep 3; kill -KILL -- -$SPID 2>/dev/null; wait 2>/dev/null
