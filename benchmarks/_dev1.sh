python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider -m gpu -rs -k "not vllm" > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log
E="--workloads docs --graph piecewise,full --modes gpu_all,kvoffload --documents 16 --requests 48 --zero-reuse-rounds 0 --verify 1 --no-plot"
for b in staged-prio staged-lp32; do
  timeout 100 python3 -m kvoffload.cli bench e2e $E --backend $b --out $R/l_$b.json > $R/l_$b.log 2>&1
  echo "== $b"; grep "p50 /\|calls per" $R/l_$b.log
done
cd $OUT && tar czf r.tgz r && rm -rf r
