#!/bin/bash
# Starts W processes of one cpgold command as the ranks of a folder launch (no MPI) and reports each rank's exit
# code. Usage: folder_ranks.sh W FOLDER CPGOLD SUBCOMMAND [ARGS...]; exits with the largest exit code.
W=$1 FOLDER=$2; shift 2
rm -rf "$FOLDER"
pids=()
for ((r = 0; r < W; r++)); do
  "$@" --launch folder --rendezvous "$FOLDER" --rank $r --world-size $W &
  pids+=($!)
done
worst=0
for ((r = 0; r < W; r++)); do
  wait ${pids[$r]}; rc=$?
  echo "folder rank $r exit $rc"
  [ $rc -gt $worst ] && worst=$rc
done
exit $worst
