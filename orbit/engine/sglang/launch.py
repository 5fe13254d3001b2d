"""`python -P launch.py ARGS`: an SGLang server as Orbit starts it (run as a script: it imports
nothing of Orbit's; -P keeps this directory, whose http.py would shadow the standard library's, off
sys.path). Two things besides `python -m sglang.launch_server ARGS`:
- the API key comes from the environment (ORBIT_SGLANG_API_KEY), so that it is on no process's
  command line;
- the server watches Orbit (ORBIT_PARENT_PID): if Orbit is gone without stopping it (SIGKILL, the
  OOM killer), it stops its own processes and removes its directory (TMPDIR), as Orbit would have
  (ServerProcess.stop in server.py), so that nothing Orbit started outlives it.
On a CPU it also forks SGLang's scheduler and detokenizer rather than spawning them (`fork_on_cpu`).
"""

import os
import runpy
import shutil
import sys
import threading
import time

KEY_ENV = "ORBIT_SGLANG_API_KEY"
PARENT_ENV = "ORBIT_PARENT_PID"


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    import psutil

    # All but the resource tracker, which unlinks the semaphores of its clients once they are gone.
    children = [
        c
        for c in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(c.cmdline())
    ]
    files = [
        f.path for c in children for f in _open_files(c) if f.path.startswith("/dev/shm/sglang_")
    ]
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)
    for path in files:
        try:
            os.unlink(path)
        except OSError:
            pass
    shutil.rmtree(os.environ.get("TMPDIR", ""), ignore_errors=True)  # its own: log and socket files
    os._exit(0)


def fork_on_cpu(args: list[str]) -> None:
    """SGLang starts its scheduler and detokenizer as spawned interpreters, each importing SGLang
    again (7-9 s of a core each here), because a CUDA context does not survive a fork. A server on
    a CPU (`--device cpu`) has no CUDA context, and this process has run no parallel torch op whose
    OpenMP workers a fork would lose: its children are forked from it, SGLang imported already. A
    tiny model's server answers /health in 12.8 s, not 19.3 (medians of 3). Not with --numa-node:
    SGLang's NUMA binding asserts spawn."""
    device = args[args.index("--device") + 1] if "--device" in args[:-1] else None
    if device != "cpu" or "--numa-node" in args:
        return
    import multiprocessing

    default = multiprocessing.set_start_method
    # what SGLang calls, asking for "spawn"
    multiprocessing.set_start_method = lambda method, force=False: default("fork", force=True)


def _open_files(proc) -> list:
    try:
        return proc.open_files()
    except Exception:  # noqa: BLE001 - gone already
        return []


if __name__ == "__main__":
    key = os.environ.pop(KEY_ENV, None)
    if key:
        sys.argv[1:1] = ["--api-key", key]
    parent = os.environ.pop(PARENT_ENV, None)
    if parent:
        threading.Thread(
            target=watch_parent, args=(int(parent),), name="orbit-parent-watch", daemon=True
        ).start()
    fork_on_cpu(sys.argv)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
