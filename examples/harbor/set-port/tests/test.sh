#!/bin/bash
# The reward: 1 when the port is 8443 and the other settings are untouched, else 0.
python3 - <<'PY'
import configparser
config = configparser.ConfigParser()
config.read("/app/service.ini")
server = config["server"] if config.has_section("server") else {}
ok = dict(server) == {"host": "0.0.0.0", "port": "8443", "workers": "2"}
print("server settings:", dict(server))
open("/logs/verifier/reward.txt", "w").write("1\n" if ok else "0\n")
PY
