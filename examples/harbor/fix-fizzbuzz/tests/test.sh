#!/bin/bash
# The reward, as JSON (reward.json): 1 when every test passes, else 0; the counts beside it.
cd /tests
python3 -m pytest -q -p no:cacheprovider -rA test_fizzbuzz.py > /logs/verifier/pytest.txt 2>&1
cat /logs/verifier/pytest.txt
passed=$(grep -c '^PASSED ' /logs/verifier/pytest.txt)
failed=$(grep -cE '^(FAILED|ERROR) ' /logs/verifier/pytest.txt)
total=$((passed + failed))
python3 - "$passed" "$total" <<'PY'
import json, sys
passed, total = int(sys.argv[1]), int(sys.argv[2])
reward = 1.0 if total and passed == total else 0.0
json.dump({"reward": reward, "passed": passed, "total": total}, open("/logs/verifier/reward.json", "w"))
PY
