#!/usr/bin/env bash
# Every study of docs/results.md on one corpus, one job after another: seeds (the spread), backends,
# ablation, and on shakespeare the scaling study. Resumable: rerun the same command and finished jobs
# are skipped, an interrupted job continues from its last checkpoint. Records land in results/study/.
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
studies=(study_seeds study_backends study_ablation)
[ "$corpus" = shakespeare ] && studies+=(study_scaling)
for study in "${studies[@]}"; do
  echo "== $study on $corpus"
  "$train" -m "experiment=$study" "data=$corpus" "$@" || status=$?
  [ "$status" -eq 0 ] || [ "$status" -eq 1 ] || exit "$status"   # 1: some job failed (recorded); else stop
done
exit "$status"
