#!/usr/bin/env bash
# Speed and WER of the bundled Piper voice on this machine's CPU, against a real server.
# Usage (from the repository root, in the project's venv): benchmarks/cpu_voice.sh [PORT]
# Writes benchmarks/results/cpu_voice_speed.json (streaming), cpu_voice_speed_nonstream.json
# and cpu_voice_wer.json. Needs the bench extra: pip install -e '.[bench]'.
set -euo pipefail
port=${1:-8140}
out=benchmarks/results
omnistage serve --port "$port" --log-level warning >"$out/.server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
url="http://127.0.0.1:$port"
omnistage bench speed --base-url "$url" --concurrency 1 4 --stream --num-requests 30 --warmup 2 \
  --output "$out/cpu_voice_speed.json"
omnistage bench speed --base-url "$url" --concurrency 1 4 --no-stream --num-requests 30 --warmup 2 \
  --output "$out/cpu_voice_speed_nonstream.json"
omnistage bench wer --base-url "$url" --concurrency 2 --output "$out/cpu_voice_wer.json"
rm -f "$out/.server.log"
