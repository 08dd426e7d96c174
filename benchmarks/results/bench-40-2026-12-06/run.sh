#!/bin/bash
# Issue 40's done-when: `mooncake-te bench` before the redesign (0467ad4, built in
# /work/wt-base40) and after (main), alternating, 5 rounds, loopback TCP and shm.
cd /tmp
for r in 1 2 3 4 5; do for t in /work/wt-base40 /work/main; do
  n=$( [ $t = /work/main ] && echo main || echo base )
  for proto in tcp shm; do
  echo "== $r $n $proto"
  PYTHONPATH=$t /work/main/.venv/bin/python -m mooncake_te bench --host 127.0.0.1 --protocol $proto --block-sizes 4K,64K,1M --duration 0.5 --json --no-progress > /tmp/b40_${n}_${proto}_$r.json 2>/tmp/b40_err.txt || cat /tmp/b40_err.txt
  /work/main/.venv/bin/python -c "
import json,sys; d=json.load(open('/tmp/b40_${n}_${proto}_$r.json'))
for p in d['points']: print(p['op'], p['block_size'], round(p['bytes']/p['seconds']/1e9,3) if 'bytes' in p else p.get('gbps'))
for s in d.get('sync', []): print('sync', s['op'], s['lat_us']['p50'])
"
  done
done; done
