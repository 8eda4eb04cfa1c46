#!/usr/bin/env bash
# Every figure the GPU path is judged by, in one run on a GPU machine (the README's "On a GPU machine"
# commands), each step under its own time limit; a step that fails or runs out of time is reported
# and the next one runs.  From the project's root, after the install (../shared/gpu/README.md):
#
#   bash tests/gpu_check.sh [DIR] [STEP ...]
#
# DIR (default: $OUT, else ./gpu-check) receives each step's log and JSON; STEPs (default: all, in this
# order): tests kernels allreduce tune train (tune first: bench train then also times the profile it
# stored).  The summary at the end names each step's exit status and seconds (124: it ran out of
# time); the script exits 1 when any step failed.  A step's log and JSON from an earlier run in DIR
# are removed before it runs.  More steps, run only when named: train1 (bench train at one rank, where
# DDP uses NCCL and tunelab's optimizer sends nothing), phases (tests/gpu_step_phases.py: a training step's
# host time by phase, plain against tunelab's coordinator), profile (tests/gpu_call_profile.py at 1 and 2 ranks),
# cycles (tests/gpu_step_phases.py at one rank for cycle times from 1 to 100 ms), gil (the same at a 1 ms
# cycle for GIL switch intervals from 5000 to 50 us), cycle10 (bench train at 2 ranks with a 1 ms cycle, the
# default until 2026-11-28, and with 10 ms, today's default, alternated twice).
set -u
DIR=${1:-${OUT:-gpu-check}}
shift $(( $# > 0 ? 1 : 0 ))
STEPS=${*:-tests kernels allreduce tune train}
mkdir -p "$DIR"
export TUNELAB_HOME="$DIR/home"   # a fresh profile store: tune starts from nothing
SUMMARY=()
FAILED=0

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 t0 rc
    shift 2
    local cmd="$*"
    echo "## $name: ${cmd:0:160}"
    t0=$(date +%s)
    rm -f "$DIR/$name.log" "$DIR/$name.json" "$DIR/$name"-*.log  # nothing of an earlier run is read as this one's
    timeout --kill-after=10 "$limit" "$@" >"$DIR/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    SUMMARY+=("$name rc=$rc $(( $(date +%s) - t0 ))s")
    tail -n 40 "$DIR/$name.log"  # (the whole log stays in DIR)
}

for s in $STEPS; do
    case $s in
        tests)
            # three shards at once (the GPU is not timed here; most of the time is compiling kernels
            # and starting ranks), each with its own log: tests-kernels, tests-device, tests-rest
            step tests 300 bash -c '
                d=$1; pids=(); rc=0
                args=(-m gpu --require-gpu -v -rfEs --durations=5 -o addopts="" -p no:cacheprovider)
                python3 -m pytest "${args[@]}" tests/test_kernels_gpu.py >"$d/tests-kernels.log" 2>&1 & pids+=($!)
                python3 -m pytest "${args[@]}" tests/test_device_path.py >"$d/tests-device.log" 2>&1 & pids+=($!)
                python3 -m pytest "${args[@]}" tests --ignore=tests/test_kernels_gpu.py \
                    --ignore=tests/test_device_path.py >"$d/tests-rest.log" 2>&1 & pids+=($!)
                for p in "${pids[@]}"; do wait "$p" || rc=1; done
                for f in kernels device rest; do echo "# tests-$f"; tail -n 12 "$d/tests-$f.log"; done
                exit $rc' _ "$DIR" ;;
        kernels)
            step kernels-cupy 120 tunelab bench kernels --backend cupy --json "$DIR/kernels-cupy.json" --no-report
            step kernels-numba 120 tunelab bench kernels --backend numba-cuda --json "$DIR/kernels-numba.json" \
                --no-report ;;
        allreduce)
            step allreduce-np1 120 tunelab bench allreduce --device cuda --np 1 --sizes 4KiB,64MiB \
                --algorithms ring,mpi,bound --json "$DIR/allreduce-np1.json" --no-report
            step allreduce-np2 180 tunelab bench allreduce --device cuda --np 2 --sizes 4KiB,1MiB,64MiB \
                --algorithms ring,mpi,bound --json "$DIR/allreduce-np2.json" --no-report ;;
        train)
            step train 300 tunelab bench train --device cuda --np 2 --image-size 224 --batch-size 32 --iters 20 \
                --rounds 3 --json "$DIR/train.json" --no-report ;;
        train1)  # one rank: NCCL runs there, so DDP's baseline is NCCL's
            step train1 180 tunelab bench train --device cuda --np 1 --image-size 224 --batch-size 32 --iters 20 \
                --rounds 3 --json "$DIR/train1.json" --no-report ;;
        phases)  # a training step's host time by phase, plain torch against the DistributedOptimizer at the
            # default knobs (a 10 ms cycle since 2026-11-28; the records in docs/gpu.md before that ran 1 ms)
            # (then where the host time goes, by function: cProfile slows it, so a run of its own)
            step phases 240 bash -c 'python3 tests/gpu_step_phases.py plain && python3 tests/gpu_step_phases.py tunelab &&
                python3 tests/gpu_step_phases.py tunelab --steps 10 --profile 20' ;;
        cycles)  # one rank's step against the cycle time: how many engine calls run during backward,
            # and what they cost the autograd thread (its hooks wait for the GIL while the coordinator holds it)
            step cycles 200 bash -c 'python3 tests/gpu_step_phases.py plain --steps 20 &&
                for c in 1 2 5 10 20 100; do
                    python3 tests/gpu_step_phases.py tunelab --steps 20 --knob cycle_time_ms=$c || exit 1; done' ;;
        gil)  # one rank's step at a 1 ms cycle against Python's GIL switch interval (5000 us by default):
            # how long the autograd thread waits for the GIL behind the coordinator's thread
            step gil 200 bash -c 'python3 tests/gpu_step_phases.py plain --steps 20 &&
                for s in 5000 1000 200 50; do
                    python3 tests/gpu_step_phases.py tunelab --steps 20 --switch-us $s --knob cycle_time_ms=1 || exit 1; done' ;;
        cycle10)  # 2 ranks sharing the GPU: a 1 ms cycle against the default 10 ms, alternated twice (A B A B),
            # each run with its own no-communication bound, so each row reads against its own run
            step cycle10 400 bash -c 'for i in 1 2; do for c in 1 10; do
                    tunelab bench train --device cuda --np 2 --image-size 224 --batch-size 32 --iters 20 --rounds 3 \
                        --knob cycle_time_ms=$c --json "$1/cycle10-c$c-r$i.json" --no-report || exit 1; done; done' _ "$DIR" ;;
        profile)  # one engine call's time and where its host time goes, at 1 and 2 ranks
            step profile 180 bash -c 'M=$(dirname "$(python3 -c "import sys; print(sys.executable)")")/mpiexec
                python3 tests/gpu_call_profile.py --out "$1" --top 14 &&
                "$M" -n 2 python3 tests/gpu_call_profile.py --out "$1" --top 14' _ "$DIR" ;;
        tune)
            step tune 420 tunelab tune --model resnet50 --device cuda --image-size 224 --batch-size 32 \
                --json "$DIR/tune.json" --no-report ;;
        *)
            echo "gpu_check.sh: unknown step '$s' (steps: tests kernels allreduce tune train train1 phases profile cycles gil cycle10)" >&2
            exit 2 ;;
    esac
done
echo "## summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$DIR/summary.txt"
exit "$FAILED"
