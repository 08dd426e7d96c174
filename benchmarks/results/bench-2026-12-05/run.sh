#!/bin/bash
cd /tmp
for r in 1 2 3 4 5; do for t in /work/main /work/wt-perf3; do
  echo "== $r $t"
  PYTHONPATH=$t /work/main/.venv/bin/python -m mooncake_te bench --host 127.0.0.1 --protocol tcp --block-sizes 4K,64K,1M --duration 0.5 --json --no-progress > /tmp/perf3_bench_$(basename $t)_$r.json 2>/tmp/perf3_bench_err.txt
  /work/main/.venv/bin/python -c "
import json,sys; d=json.load(open('/tmp/perf3_bench_$(basename $t)_$r.json'))
for p in d['points']: print(p['op'], p['block_size'], round(p['bytes']/p['seconds']/1e9,3) if 'bytes' in p else p.get('gbps'))
for s in d.get('sync', []): print('sync', s['op'], s['lat_us']['p50'])
"
done; done
