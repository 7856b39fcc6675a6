cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3; do
 for pin in "" "--pin-cores"; do
  for q in "" "--quiet-ms 0"; do
   tag="r$r${pin:+-pin}${q:+-q0}"
   .venv/bin/meshd bench fetch --synthetic-mb 150 --json $pin $q > ${OUT:-/tmp}/fab-$tag.json 2>/dev/null
   python3 -c "
import json,os; d=json.load(open('${OUT:-/tmp}/fab-$tag.json')); print('$tag', d['verify_rtt_ratio'], d['fetch_mb_s'], d['fetch_verify_mb_s'], d['verify_rtt_idle_ms'], d['verify_rtt_busy_ms'], os.getloadavg()[0])"
  done
 done
done
