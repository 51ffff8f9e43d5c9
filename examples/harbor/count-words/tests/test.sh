#!/bin/bash
# The reward: 1 when /app/count.txt holds the number of words in /app/notes.txt, else 0.
expected=$(wc -w < /app/notes.txt)
if [ -f /app/count.txt ] && [ "$(tr -d '[:space:]' < /app/count.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "expected $expected in /app/count.txt"
  echo 0 > /logs/verifier/reward.txt
fi
