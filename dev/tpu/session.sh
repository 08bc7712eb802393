#!/usr/bin/env bash
# One device call's worth of TPU checks, in the order they matter; each step has its own time
# limit and writes under $OUT (logs and JSON), so that a step that hangs loses only itself.
#
#   PYTHONPATH=$PYTHONPATH:$PWD/src bash dev/tpu/session.sh [STEP ...]
#
# STEPs: tests, chamfer, chamfer_98k, segments, segments_rest, segments_mean,
# segments_softmax, sorted_grads, sorted_compile, lse, lse_ref, lse_acc, lce, heads, cauchy_rows, cauchy, knn, cli, knn_whole, knn_compile, chamfer_parts,
# chamfer_buffers, argmin. A device call runs at most 10 minutes: run
# `session.sh tests chamfer segments`, then `session.sh cauchy knn cli` (each within 9 min).
# Before the call: python dev/tpu/preflight.py (lowers the same workloads here, no TPU needed).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
steps=${*:?name the steps (see above)}
here=$(dirname "$0")
quiet() { grep -v -i -e warn -e "^  warnings" -e symbolize -e "RAW: "; }
for step in $steps; do
  case $step in
    tests)  # the kernels compiled on the TPU (FOLDAX_TPU=1: without it they run interpreted)
      FOLDAX_TPU=1 timeout 200 python -m pytest tests/test_tpu_kernels.py \
        tests/test_kernel_lanes.py -q -p no:xdist \
        -W "ignore:cloud_tpu_init failed" -W "ignore:Transparent hugepages" --tb=short 2>&1 \
        | tee "$OUT/tests.txt" | tail -25 ;;
    chamfer)  # the Chamfer gradient, vmapped over 4 pairs of 16k and of 98k points (blocks
      # sized for VMEM; the pass over tied rows restricted to them)
      timeout 240 python "$here/run.py" chamfer 2>&1 | quiet | tee "$OUT/chamfer.log"
      mv "$OUT/tpu.json" "$OUT/chamfer.json" ;;
    chamfer_98k)  # the Chamfer gradient at 98,304 points alone, as chosen
      CHAMFER_SIZES=98304 timeout 120 python "$here/run.py" chamfer 2>&1 | quiet \
        | tee "$OUT/chamfer_98k.log"
      mv "$OUT/tpu.json" "$OUT/chamfer_98k.json" ;;
    segments)  # sorted ids: jax.ops' scatters (they walked before, 38x slower)
      FAMILIES_ORDERS=sorted FAMILIES_SEGMENTS=segment_sum,segment_max,segment_softmax \
        timeout 150 python "$here/families.py" segments 2>&1 | quiet | tee "$OUT/segments.log"
      mv "$OUT/families.json" "$OUT/segments.json" ;;
    segments_rest)  # sorted ids: the mean, the log-sum-exp and the softmax
      FAMILIES_ORDERS=sorted FAMILIES_SEGMENTS=segment_mean,segment_logsumexp,segment_softmax \
        timeout 400 python "$here/families.py" segments 2>&1 | quiet | tee "$OUT/segments_rest.log"
      mv "$OUT/families.json" "$OUT/segments_rest.json" ;;
    segments_mean)  # the mean, unsorted and sorted ids
      FAMILIES_SEGMENTS=segment_mean timeout 300 python "$here/families.py" segments 2>&1 \
        | quiet | tee "$OUT/segments_mean.log"
      mv "$OUT/families.json" "$OUT/segments_mean.json" ;;
    segments_softmax)  # the softmax, sorted ids
      FAMILIES_ORDERS=sorted FAMILIES_SEGMENTS=segment_softmax timeout 300 \
        python "$here/families.py" segments 2>&1 | quiet | tee "$OUT/segments_softmax.log"
      mv "$OUT/families.json" "$OUT/segments_softmax.json" ;;
    lse_ref)  # the same ways, each against a float64 gradient of sampled segments
      LSE_REFERENCE=1 timeout 300 python "$here/lse_variants.py" 2>&1 | quiet | tee "$OUT/lse_ref.log"
      mv "$OUT/lse_variants.json" "$OUT/lse_ref.json" ;;
    sorted_grads)  # segment gradients with sorted ids, compile and run, foldax then jax.ops
      SORTED_WHAT=grad timeout 200 python "$here/sorted_grads.py" 2>&1 | quiet \
        | tee "$OUT/sorted_grads.log" ;;
    sorted_compile)  # a scatter's and a gather's compile and run with the sorted hint or not
      timeout 200 python "$here/sorted_compile.py" 2>&1 | quiet | tee "$OUT/sorted_compile.log" ;;
    lse_acc)  # a segment log-sum-exp's forward and gradient against float64, and its pieces
      timeout 150 python "$here/lse_accuracy.py" 2>&1 | quiet | tee "$OUT/lse_acc.log" ;;
    lce)  # the language-model loss, forward and value-and-grad, against the plain loss
      timeout 240 python "$here/run.py" lce quick 2>&1 | quiet | tee "$OUT/lce.log"
      mv "$OUT/tpu.json" "$OUT/lce.json" ;;
    heads)  # attention read in the (T, H, D) layout in place: strided loads of each head
      timeout 240 python "$here/heads_layout.py" 2>&1 | quiet | tee "$OUT/heads.log" ;;
    lse)  # a log-sum-exp's gradient by the ways its rows' weights could be gathered
      timeout 200 python "$here/lse_variants.py" 2>&1 | quiet | tee "$OUT/lse.log" ;;
    cauchy_rows)  # S4's Cauchy kernel, forward and gradient, against the broadcast sum
      timeout 150 python "$here/families.py" cauchy 2>&1 | quiet | tee "$OUT/cauchy_rows.log"
      mv "$OUT/families.json" "$OUT/cauchy_rows.json" ;;
    cauchy)  # which step a TPU wants for an elementwise kernel
      timeout 100 python "$here/families.py" cauchy_sweep 2>&1 | quiet | tee "$OUT/cauchy.log"
      mv "$OUT/families.json" "$OUT/cauchy.json" ;;
    knn)  # the k-min kernel (its lists per lane, asked for) in 784 dimensions: its compile
      # time at 2,048 x 12,288, then the full k-NN against lax.map + lax.top_k
      for sizes in ${KNN_ALL_SIZES:-2048,12288,784 10240,60000,784}; do
        KNN_SIZES=$sizes timeout 150 python "$here/run.py" knn 2>&1 | quiet | tee -a "$OUT/knn.log"
      done ;;
    cli)  # foldax audit on the TPU: its buffers at the peak, naive and with foldax
      for way in naive with_foldax; do
        timeout 60 python -m foldax audit "examples/audit_s4.py:$way" 2>&1 | quiet \
          | tee -a "$OUT/audit.log"
      done ;;
    argmin)  # the min family's kernel by its states: per row, per lane (asked for), minimal
      timeout 120 python "$here/argmin_variants.py" 2>&1 | quiet | tee "$OUT/argmin.log" ;;
    knn_whole|knn_compile|chamfer_parts|chamfer_buffers)  # where the time goes (dev/tpu/breakdown.py)
      timeout "$([ "$step" = knn_compile ] && echo 330 || echo 240)" python "$here/breakdown.py" "$step" 2>&1 | quiet | tee -a "$OUT/breakdown.log"
      mv "$OUT/breakdown.json" "$OUT/$step.json" ;;
    *) echo "session.sh: no step $step (steps: tests chamfer chamfer_98k segments segments_rest segments_mean" \
      "segments_softmax sorted_grads sorted_compile lse lse_ref lse_acc lce heads" \
      "cauchy_rows cauchy knn cli knn_whole knn_compile chamfer_parts chamfer_buffers argmin)" >&2
      exit 2 ;;
  esac
done
