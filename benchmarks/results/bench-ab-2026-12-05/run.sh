for r in 1 2 3 4 5 6 7 8; do for t in base main; do for p in shm; do
  d=/work/$t; [ $t = wt-base ] && d=/work/wt-base; [ $t = base ] && d=/work/wt-base
  out=$(cd $d && PYTHONPATH=$d timeout 120 /work/main/.venv/bin/python -m mooncake_te bench --host 127.0.0.1 --protocol $p --op write --block-sizes 4K,1M,16M --duration 1 --json --no-progress 2>/dev/null)
  echo "$r $t $p $(echo "$out" | python3 /tmp/fmt.py)"
done; done; done
