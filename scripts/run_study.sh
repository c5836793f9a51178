#!/usr/bin/env bash
# Every study of docs/results.md on one corpus, one job after another: backends, ablation, on
# shakespeare the scaling study, then the extra seeds of the backends (the seed-spread study).
# Resumable: rerun the same command and finished jobs are skipped, an interrupted job continues from
# its last checkpoint. Records land in results/study/.
#   scripts/run_study.sh shakespeare trainer.threads=1      # one core per corpus: run both corpora at once
#   scripts/run_study.sh ptb trainer.threads=1
# Extra arguments are Hydra overrides passed to every sweep (keep them to execution-only fields such
# as trainer.threads, or the jobs get other names and rerun).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
corpus=${1:?usage: scripts/run_study.sh CORPUS [overrides...]}
shift
train=${MSAR_TRAIN:-msar-train}
status=0
# Seeds 1-3 of every study first (the report's minimum), then seeds 4-5 of the backends (which are also
# the seed study's runs: same jobs, same names, so study_seeds finds them done).
steps=("study_backends trainer.seed=1,2,3" "study_ablation" "study_backends" "study_seeds")
[ "$corpus" = shakespeare ] && steps=("study_backends trainer.seed=1,2,3" "study_ablation" "study_scaling" "study_backends" "study_seeds")
for step in "${steps[@]}"; do
  read -r study seeds <<< "$step"
  echo "== $study ${seeds:-} on $corpus"
  # shellcheck disable=SC2086  # $seeds: zero or one override
  "$train" -m "experiment=$study" "data=$corpus" ${seeds:-} "$@" || status=$?
  [ "$status" -eq 0 ] || [ "$status" -eq 1 ] || exit "$status"   # 1: some job failed (recorded); else stop
done
exit "$status"
