python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 120 python3 benchmarks/load_rate_probe.py $R/load_rate.json 2>&1 | tee $R/load_rate.log
timeout 150 python3 benchmarks/launch_beside_copy_probe.py $R/launch_beside3.json 2>&1 | tee $R/launch_beside3.log
E="--workloads docs --graph piecewise,full --modes gpu_all,kvoffload --documents 16 --requests 48 --zero-reuse-rounds 0 --verify 1 --no-plot"
for b in auto staged-ramp staged-ms8 staged-ramp-ms8; do
  timeout 100 python3 -m kvoffload.cli bench e2e $E --backend $b --out $R/l_$b.json > $R/l_$b.log 2>&1
  echo "== $b"; grep "p50 /\|calls per" $R/l_$b.log
done
cd $OUT && tar czf r.tgz r && rm -rf r
