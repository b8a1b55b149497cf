#!/usr/bin/env bash
# The GPU measurements, in the few long commands a lent device allows (results under $OUT).
#
# Prepare on the developer machine, in the repository root (ignored folders, never committed):
#   echo /.whl/ >> .git/info/exclude; echo /.mlm/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     megatron-core==0.16.1 pydantic pydantic-core annotated-types typing-inspection
#   (the device image has pytest and pybind11; Megatron-LM's training imports megatron.rl,
#   which needs pydantic, which it lacks)
#   mkdir -p .mlm && git -C <Megatron-LM clone> archive core_v0.16.1 pretrain_gpt.py \
#     gpt_builders.py model_provider.py megatron/training megatron/legacy megatron/rl \
#     megatron/post_training | tar -x -C .mlm       # megatron.training imports the last two
# Then on the device (carry [".whl", ".mlm"]), one part per call. A copy of the tree without
# its git history cannot name its commit in the results files' provenance (benchmarks/
# provenance.py): commit first, then pass it, e.g.
#   TERAPIPE_BENCH_COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_session.sh stage
#   bash benchmarks/gpu_session.sh stage        # bench_stage: K = 1..32 slices vs Megatron, ~3 min
#   bash benchmarks/gpu_session.sh pipeline     # bench_gpu_pipeline: 2/4 stages under MPS, ~8 min
#   bash benchmarks/gpu_session.sh pipeline-graphs  # the same plus graphed rows: TeraPipe's graphs
#                                               # against Megatron-Core's own (cuda_graph_impl=local);
#                                               # with measured auto per way first (AUTO_TRIALS=2)
#   bash benchmarks/gpu_session.sh pipeline-eight   # pipeline-graphs on 8 stages x 4 layers, 1 microbatch
#                                               # (needs an H200: 8 processes of 9-13 GiB run out of
#                                               # an H100's 79 GiB)
#   bash benchmarks/gpu_session.sh virtual      # bench_gpu_virtual: 2 stages under MPS, 4 microbatches,
#                                               # Megatron 1F1B / interleaved vs TeraPipe on 1 and 2 chunks
#   bash benchmarks/gpu_session.sh megatron-lm  # pretrain_gpt.py, PP=1, bf16, terapipe vs 1f1b (same attention)
#   bash benchmarks/gpu_session.sh megatron-lm-profile  # the same, 26 iterations, the last two
#                                               # under torch.profiler: summaries, and times of 3-23
#   bash benchmarks/gpu_session.sh graphs       # replays vs eager (tests/runtime/graphs/test_gpu_graphs.py), then
#                                               # bench_stage with a CUDA graph per compute action
#   bash benchmarks/gpu_session.sh measure      # layer profiles (--timing wall and device), a plan with each,
#                                               # and a bf16 memory profile
#   LEASE_SECONDS=540 bash benchmarks/gpu_session.sh lease  # one call for a short lease: what
#       is still open (docs/performance.md): measure (the device-timed profile first),
#       pipeline-graphs on the three target cases, megatron-lm-profile (now with the callers of
#       its top ops and syncs), virtual, graphs, stage (1/8/16 slices), each cut at the
#       deadline; $OUT/results.tgz holds everything so far after each part
#       (LEASE_PARTS="graphs stage megatron-lm pipeline": another choice and order of parts;
#       PIPELINE_GRANULARITY=128: the pipeline parts' DP slices in multiples of 128 tokens;
#       PROFILE_TIMING=device: pipeline-graphs plans on a layer profile of the GPU's own time;
#       PART_SECONDS=300: the most one part may take, so a slow part leaves time to the rest).
#       A lease has 15 minutes of device time and a machine starts in 1-2: one call of
#       LEASE_SECONDS=545 with timeout_s 595 is most of it. $OUT returns at most 8 files: run
#       with OUT set to a scratch folder and copy its results.tgz to the real $OUT after.
#       The open GPU questions in their order (docs/performance.md):
#         PROFILE_TIMING=device PIPELINE_GRANULARITY=128 LEASE_SECONDS=545 \
#           LEASE_PARTS="measure pipeline-graphs megatron-lm-profile virtual" \
#           bash benchmarks/gpu_session.sh lease
set -uo pipefail
export PYTHONUNBUFFERED=1
[ -d /tmp/site/megatron/core ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-$(mktemp -d -t terapipe_gpu.XXXX)}  # results files are written by their benchmark scripts
mkdir -p "$OUT"

stage() {
  local model="--bf16 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --num-layers 4"
  python3 benchmarks/bench_stage.py --device cuda $model --slices "${STAGE_SLICES:-1,2,4,8,16,32}" \
    --out "$OUT/stage_cuda.json" 2>&1 | tee "$OUT/stage.log"
  python3 benchmarks/bench_stage.py --device cuda $model --slices 1,8,16 --defer-wgrad off \
    --out "$OUT/stage_cuda_nodefer.json" 2>&1 | tee -a "$OUT/stage.log"
}

pipeline() {
  python3 benchmarks/bench_gpu_pipeline.py --cases "${PIPELINE_CASES:-full}" \
    --repeats "${PIPELINE_REPEATS:-5}" \
    --granularity "${PIPELINE_GRANULARITY:-64}" --out "$OUT/gpu_pipeline" 2>&1 | tee "$OUT/pipeline.log"
}

graphs() {
  python3 -m pytest -q -p no:cacheprovider tests/runtime/graphs/test_gpu_graphs.py 2>&1 | tee "$OUT/graphs_test.log"
  local model="--bf16 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --num-layers 4"
  python3 benchmarks/bench_stage.py --device cuda $model --slices 1,8,16 --cuda-graphs --warmup 3 \
    --out "$OUT/stage_cuda_graphs.json" 2>&1 | tee "$OUT/graphs.log"
}

measure() {
  local model=(--hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --vocab-size 50304)
  local gpu timing profile  # the profile is named for the card it was measured on ("h100", "h200")
  # ("NVIDIA H100 80GB HBM3" -> h100: the last word, HBM3, named the H100's profile once)
  gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name()
m = re.search(r'\b[A-Z]\d{2,4}[A-Z]?\b', n); print((m.group(0) if m else n.split()[-1]).lower())")
  # device: the GPU's own time (graphed cells); wall: eager cells, host launches included.
  # Device first: the plans of the graphed rows need it, and a short lease can end before the
  # second
  for timing in device wall; do
    profile="$OUT/${gpu}_layer_profile_$timing.json"
    local command=(python3 -m megatron_terapipe.megatron.measure layers "${model[@]}" --dtype bfloat16
      --timing "$timing" --out "$profile")
    "${command[@]}" 2>&1 | tee -a "$OUT/measure.log"
    # the profile's writer is the package's: the provenance is added to the file it wrote
    python3 benchmarks/provenance.py --stamp "$profile" -- "${command[@]}"
    python3 -m megatron_terapipe.planner.cli "${model[@]}" --num-layers 32 --pipeline-stages 8 \
      --hardware h100 --profile "$profile" 2>&1 | tee -a "$OUT/measure.log"
  done
  # what a stage keeps for backward, bf16: among it the share of a layer's activations its
  # backward frees before the K/V gradients, which the analytic model only estimates (0.6
  # plain, 0.3 with deferred W; CPU profiles of the tests' tiny model give about 0.13 / -0.3)
  profile="$OUT/${gpu}_memory_profile.json"
  local command=(python3 -m megatron_terapipe.megatron.measure memory "${model[@]}" --dtype bfloat16
    --out "$profile")
  "${command[@]}" 2>&1 | tee -a "$OUT/measure.log"
  python3 benchmarks/provenance.py --stamp "$profile" -- "${command[@]}"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('freed before K/V gradients:',
    'plain', round(d['freed_before_kv_grad'], 3), 'deferred', round(d['freed_before_kv_grad_deferred'], 3))" \
    "$profile" 2>&1 | tee -a "$OUT/measure.log"
}

pipeline_graphs() {  # PROFILE_TIMING=device: plans and predictions on the GPU's own time
  python3 benchmarks/bench_gpu_pipeline.py --cuda-graphs --cases "${PIPELINE_CASES:-full}" \
    --repeats "${PIPELINE_REPEATS:-5}" --profile-timing "${PROFILE_TIMING:-wall}" \
    --auto-trials "${AUTO_TRIALS:-2}" --granularity "${PIPELINE_GRANULARITY:-64}" --out "$OUT/gpu_pipeline_graphs" 2>&1 | tee "$OUT/pipeline_graphs.log"
}

# The same on 32 layers in 8 stages (terapipe-plan's question at 1 microbatch), each stage an
# eighth of the SMs
pipeline_eight() {
  python3 benchmarks/bench_gpu_pipeline.py --cuda-graphs --cases eight --repeats "${PIPELINE_REPEATS:-5}" \
    --granularity "${PIPELINE_GRANULARITY:-64}" \
    --out "$OUT/gpu_pipeline_eight" 2>&1 | tee "$OUT/pipeline_eight.log"
}

virtual() {
  python3 benchmarks/bench_gpu_virtual.py --microbatches "${VIRTUAL_MICROBATCHES:-4}" \
    --rounds "${PIPELINE_REPEATS:-5}" --out "$OUT/gpu_virtual" 2>&1 | tee "$OUT/virtual.log"
}

# Each part in its own process group under what is left of the lease; everything so far is
# packed after each part, so a part cut at the deadline still leaves the earlier ones.
lease() {
  local deadline=$((SECONDS + ${LEASE_SECONDS:-540})) part left
  local work=$OUT
  export OUT=$work/lease && mkdir -p "$OUT"
  { nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } \
    2>&1 | tee "$OUT/device.log"
  export STAGE_SLICES=1,8,16 PIPELINE_CASES=targets PIPELINE_REPEATS=3
  for part in ${LEASE_PARTS:-measure pipeline-graphs megatron-lm-profile virtual graphs stage}; do
    left=$((deadline - SECONDS - 15))
    if ((left < 30)); then echo "lease: no time left for $part" | tee -a "$OUT/lease.log"; continue; fi
    echo "lease: $part with ${left}s left" | tee -a "$OUT/lease.log"
    # one part takes at most PART_SECONDS (default 300), so a slow one leaves time to the rest
    ((left > ${PART_SECONDS:-300})) && left=${PART_SECONDS:-300}
    timeout -k 5 "$left" bash "$0" "$part"
    echo "lease: $part exit $? at ${SECONDS}s" | tee -a "$OUT/lease.log"
    tar -czf "$work/results.tgz" -C "$work" lease
  done
}

# Megatron-LM's pretrain_gpt.py on one GPU (PP=1, bf16): one run per schedule, `$1` the log's
# name, the rest extra flags
pretrain_gpt() {
  # Megatron-LM's initialize runs `make` in megatron/core/datasets on rank 0; the wheel ships the
  # helper already built but no Makefile: one that checks for the built helper stands in
  local datasets=/tmp/site/megatron/core/datasets log=$1 && shift
  [ -f $datasets/Makefile ] || printf 'default:\n\tls helpers_cpp*.so\n' > $datasets/Makefile
  local args=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4
    --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 1 --global-batch-size 4 --train-iters 20 --lr 1e-4 --log-interval 1
    --eval-iters 0 --eval-interval 1000 --bf16 --transformer-impl local --attention-dropout 0
    --hidden-dropout 0 --no-persist-layer-norm --no-gradient-accumulation-fusion
    --no-masked-softmax-fusion)  # (the last three: apex's kernels, which the image lacks)
  (cd .mlm && PYTHONPATH=$PWD:$PYTHONPATH torchrun --nproc-per-node 1 \
    -m megatron_terapipe.megatron.launch pretrain_gpt.py "${args[@]}" "$@") 2>&1 \
    | tee "$OUT/$log.log" | grep -E "iteration +[0-9]+/|Error"
}

# 1f1b runs on the same slice-aware attention (SDPA) as terapipe: like for like
same_model() { [ "$1" = 1f1b ] && echo --terapipe-slice-aware-model; }

megatron_lm() {
  for schedule in terapipe 1f1b; do
    # shellcheck disable=SC2046
    pretrain_gpt "megatron_lm_$schedule" --pipeline-schedule "$schedule" $(same_model "$schedule") \
      --train-iters 24
  done
  python3 benchmarks/megatron_lm_logs.py "$OUT"  # losses and times side by side: megatron_lm.json
}

# The same two runs, 26 iterations, under torch.profiler for iterations 24-25 (Megatron-LM's
# --profile); the traces' summaries come back (host vs GPU time, launches, syncs, top host ops),
# and the losses and times of iterations 3-23 side by side (the profiler's own are left out)
megatron_lm_profile() {
  local schedule traces=()
  for schedule in terapipe 1f1b; do
    rm -rf "/tmp/trace_$schedule"
    # shellcheck disable=SC2046
    pretrain_gpt "megatron_lm_profile_$schedule" --pipeline-schedule "$schedule" \
      $(same_model "$schedule") --train-iters 26 \
      --profile --use-pytorch-profiler --profile-step-start 24 --profile-step-end 26 \
      --tensorboard-dir "/tmp/trace_$schedule"
    traces+=(/tmp/trace_"$schedule"/*.json*)
  done
  python3 benchmarks/trace_summary.py "${traces[@]}" --out "$OUT/megatron_lm_profile.json" \
    2>&1 | tee "$OUT/megatron_lm_profile.log"
  python3 benchmarks/megatron_lm_logs.py "$OUT" --prefix megatron_lm_profile --through 23 \
    2>&1 | tee -a "$OUT/megatron_lm_profile.log"
}

case "${1:-}" in
  stage) stage ;;
  pipeline) pipeline ;;
  pipeline-graphs) pipeline_graphs ;;
  pipeline-eight) pipeline_eight ;;
  virtual) virtual ;;
  megatron-lm) megatron_lm ;;
  megatron-lm-profile) megatron_lm_profile ;;
  graphs) graphs ;;
  measure) measure ;;
  lease) lease ;;
  *) echo "usage: $0 stage|pipeline|pipeline-graphs|pipeline-eight|virtual|megatron-lm|megatron-lm-profile|graphs|measure|lease" >&2; exit 2 ;;
esac
