"""This machine and this process: ports (net.py), directories written whole (files.py), a scratch
directory per process (scratch.py), processes forked from a fork server (forks.py), what decides
this machine's floats (floats.py), Ctrl-C (interrupts.py), secrets kept out of logs (secret.py) and
torch's CPU threads per thread (threads.py)."""
