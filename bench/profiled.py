"""Run a module under cProfile that only records between signals SIGRTMIN+3 (start) and SIGRTMIN+4 (stop, write).

    python -m bench.profiled OUT_FILE -m MODULE [ARGS...]

bench.pipeline uses it (``ROLLWIRE_BENCH_PROFILE=FILE``) to profile the worker during the flood phase
only, not its start-up (metadata of every topic on a shared broker, table recovery).
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys


def main() -> None:
    out, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit("usage: python -m bench.profiled OUT_FILE -m MODULE [ARGS...]")
    profile = cProfile.Profile()
    signal.signal(signal.SIGRTMIN + 3, lambda *_: profile.enable())

    def stop(*_: object) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGRTMIN + 4, stop)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
