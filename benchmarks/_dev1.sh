python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
E="--workloads docs --graph piecewise,full --modes gpu_all,kvoffload --documents 16 --requests 48 --zero-reuse-rounds 0 --verify 1 --no-plot"
Q="--model qwen2.5-7b --block-size 32"
for run in "l auto 1" "l staged-lp132 1" "q auto 1" "q staged-lp132 1" "l auto 2" "l staged-lp132 2"; do
  set -- $run; M=""; [ $1 = q ] && M="$Q"
  timeout 100 python3 -m kvoffload.cli bench e2e $M $E --backend $2 --out $R/$1_$2_$3.json > $R/$1_$2_$3.log 2>&1
  echo "== $run"; grep "p50 /" $R/$1_$2_$3.log
done
cd $OUT && tar czf r.tgz r && rm -rf r
